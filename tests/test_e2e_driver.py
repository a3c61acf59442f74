"""The engines' end-to-end driver (``tests/gpu/vllm_e2e.py``, shared by ``sglang_e2e.py``) on the CPU, with a
stand-in worker script: an engine that fails leaves its output's last lines in the report, the pairs without it are
still compared and judged, and the run exits non-zero."""

import argparse
import json
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
import vllm_e2e  # noqa: E402

WORKER = textwrap.dedent('''
    import json, sys
    from pathlib import Path

    task = json.loads(Path(sys.argv[3]).read_text())
    engine, workdir = task["engine"], Path(task["workdir"])
    print(f"{engine} starting")
    if engine == "BROKEN":
        print("Traceback (most recent call last):\\nRuntimeError: the engine broke")
        sys.exit(3)
    shift = {"FLOOR": 0.01, "OURS": 0.015}.get(engine, 0.0)
    result = {"engine": engine, "generated": [{"logprobs": [-1.0, -2.0, -3.0]}], "scores": {}}
    for other in task.get("score", []):
        decoded = json.loads((workdir / f"{other}.json").read_text())["generated"]
        result["scores"][other] = [[lp + shift for lp in seq["logprobs"]] for seq in decoded]
    if task.get("throughput"):  # a second run of an engine (suffix -throughput-2) takes twice as long
        scale = 2.0 if task.get("suffix", "").endswith("-2") else 1.0
        passes = [{"total_s": t * scale, "prefill_s": 0.5, "output_tok_s": 4.0 / (t * scale)} for t in (3.0, 1.0, 2.0)]
        result["throughput"] = [{"requests": 1, "prompt_len": 2, "output_len": 3, **passes[2], "passes": passes}]
    (workdir / f"{engine}{task.get('suffix', '')}.json").write_text(json.dumps(result))
''')


def args(tmp_path, **overrides):
    (tmp_path / "tiny-dsv3").mkdir(exist_ok=True)
    (tmp_path / "tiny-dsv3" / "config.json").write_text("{}")  # tiny_model() then builds nothing
    values = dict(throughput_only=None, group="g", workdir=str(tmp_path), out=str(tmp_path / "report.json"),
                  reuse=False, throughput=False, widths="tiny", floor=None)
    return argparse.Namespace(**{**values, **overrides})


def run_driver(tmp_path, **overrides):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    pairs = {"g": [("REF", "FLOOR"), ("REF", "OURS"), ("REF", "BROKEN")]}
    with pytest.raises(SystemExit) as exit_:
        vllm_e2e.driver(args(tmp_path, **overrides), ("REF", "FLOOR", "OURS", "BROKEN"), pairs, str(script),
                        is_floor=lambda name: name == "FLOOR", engine_env={})
    return json.loads((tmp_path / "report.json").read_text()), str(exit_.value)


def test_a_failed_engine_is_reported_and_the_others_still_judged(tmp_path):
    report, message = run_driver(tmp_path)
    assert "engines that failed: ['BROKEN']" in message
    assert "agreement beyond twice the floor: []" in message
    broken = report["failed_engines"]["BROKEN"]
    assert broken["failed"] == 3 and "RuntimeError: the engine broke" in broken["log_tail"]
    judged = {(p["decoded_by"], p["scored_by"]): p for p in report["pairs"]}
    assert judged[("REF", "FLOOR")]["mean"] == pytest.approx(0.01)
    assert judged[("REF", "OURS")]["mean"] == pytest.approx(0.015)
    assert judged[("REF", "BROKEN")]["skipped"] and judged[("BROKEN", "REF")]["skipped"]
    assert report["floor"]["mean"] == pytest.approx(0.01)
    assert (tmp_path / "BROKEN.log").read_text().startswith("BROKEN starting")


def test_throughput_only_times_the_engines_that_run(tmp_path):
    report, message = run_driver(tmp_path, throughput_only=["OURS", "BROKEN"])
    assert message == "engines that failed: ['BROKEN']"
    assert report["engines"]["OURS"]["throughput"][0]["output_tok_s"] == 2.0
    assert report["engines"]["OURS"]["runs"] == 1
    assert "BROKEN" not in report["engines"] and report["failed_engines"]["BROKEN"]["failed"] == 3


def test_an_engine_named_twice_runs_twice_and_its_passes_are_pooled(tmp_path):
    report, message = run_driver(tmp_path, throughput_only=["OURS", "REF", "OURS", "BROKEN"])
    assert message == "engines that failed: ['BROKEN']"
    ours = report["engines"]["OURS"]
    assert ours["runs"] == 2 and report["engines"]["REF"]["runs"] == 1
    case = ours["throughput"][0]
    assert sorted(p["total_s"] for p in case["passes"]) == [1.0, 2.0, 2.0, 3.0, 4.0, 6.0]
    assert [p["run"] for p in case["passes"]] == [0, 0, 0, 1, 1, 1]
    assert case["total_s"] == 3.0 and case["output_tok_s"] == pytest.approx(4.0 / 3.0) and "run" not in case
    assert (case["requests"], case["prompt_len"], case["output_len"]) == (1, 2, 3)
    assert (tmp_path / "OURS-throughput.log").exists() and (tmp_path / "OURS-throughput-2.log").exists()
