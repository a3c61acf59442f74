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
    if task.get("throughput"):
        result["throughput"] = [{"requests": 1, "prompt_len": 2, "output_len": 3, "output_tok_s": 4.0,
                                 "prefill_s": 0.5, "total_s": 1.0}]
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
    assert report["engines"]["OURS"]["throughput"][0]["output_tok_s"] == 4.0
    assert "BROKEN" not in report["engines"] and report["failed_engines"]["BROKEN"]["failed"] == 3
