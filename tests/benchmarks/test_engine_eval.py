"""The reference model's engine table: which rows a checkpoint gets, and how rows are compared
(the engine runs themselves are GPU work; here a stand-in scorer returns known log-probs)."""

import json
import math
import time

import pytest

from benchmarks.reference_model import engine_eval
from latentspeed.metrics import Position
from tests.test_evaluate import tiny_model  # noqa: F401 (fixture)


def write_config(path, quantization_config):
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"quantization_config": quantization_config}))
    return str(path)


def test_fp8_block_checkpoints_of_either_format_also_run_under_latentspeed_and_kv_schemes_bring_an_fp8_cache(tmp_path):
    fp8_block = {"weights": {"type": "float", "num_bits": 8, "strategy": "block"}}
    nvfp4 = {"weights": {"type": "float", "num_bits": 4, "strategy": "tensor_group"}}
    block = write_config(tmp_path / "a", {"config_groups": {"group_0": fp8_block}})
    block_kv = write_config(tmp_path / "b", {"config_groups": {"group_0": fp8_block}, "kv_cache_scheme": {"num_bits": 8}})
    mixed = write_config(tmp_path / "c", {"config_groups": {"group_0": fp8_block, "group_1": nvfp4}})
    native = write_config(tmp_path / "d", {"quant_method": "fp8", "weight_block_size": [128, 128]})
    per_tensor = write_config(tmp_path / "e", {"quant_method": "fp8"})

    assert engine_eval.checkpoint_runs("vllm", "fp8-block", block) == {
        "fp8-block: stock vllm": ("FLASHMLA", "auto", None, block),
        "fp8-block: latentspeed_fp8, CUSTOM": ("CUSTOM", "auto", "latentspeed_fp8", block),
    }
    assert engine_eval.checkpoint_runs("sglang", "kv", block_kv) == {
        "kv: stock sglang": ("triton", "fp8_e4m3", None, block_kv),
        "kv: latentspeed_fp8, latentspeed": ("latentspeed", "fp8_e4m3", "latentspeed_fp8", block_kv),
    }
    assert engine_eval.checkpoint_runs("vllm", "mixed", mixed) == {"mixed: stock vllm": ("FLASHMLA", "auto", None, mixed)}
    assert engine_eval.checkpoint_runs("sglang", "native", native) == {
        "native: stock sglang": ("triton", "auto", None, native),
        "native: latentspeed_fp8, latentspeed": ("latentspeed", "auto", "latentspeed_fp8", native),
    }
    assert list(engine_eval.checkpoint_runs("vllm", "t", per_tensor)) == ["t: stock vllm"]


@pytest.mark.parametrize("parallel", [1, 3])
def test_rows_are_compared_with_the_first_and_a_failed_row_is_kept(tiny_model, tmp_path, monkeypatch, parallel):  # noqa: F811
    (tiny_model / "heldout.txt").write_text("def add(a, b):\n    return a + b\n" * 20)
    calls = []

    def scorer(spec):
        calls.append(spec)
        if spec["quantization"] == "fp8_per_block":
            raise RuntimeError("the vllm run failed (exit 1); its log is above")
        reference = spec["attention_backend"] == "FLASHMLA" and spec["kv_cache_dtype"] == "auto"
        if reference and parallel > 1:
            time.sleep(0.5)  # the reference row finishes last
        shift = 0.0 if reference else 0.1
        tokens = [t for w in spec["windows"] for t in w[1:]]
        return [Position(t, math.log(0.5) - shift, {t: math.log(0.5) - shift}) for t in tokens]

    monkeypatch.setattr(engine_eval, "score_in_subprocess", scorer)
    out = tmp_path / "eval.json"
    report = engine_eval.main(["--engine", "vllm", "--model", str(tiny_model), "--window", "16", "--out", str(out),
                               "--parallel", str(parallel)])

    assert json.loads(out.read_text()) == report
    rows = {row["label"]: row for row in report["rows"]}
    assert list(rows) == list(engine_eval.RUNS["vllm"]) and len(calls) == len(rows)
    assert "agreement" not in rows["FLASHMLA, bf16"] and rows["FLASHMLA, bf16"]["perplexity"] == pytest.approx(2)
    custom = rows["latentspeed (CUSTOM), bf16"]
    assert custom["agreement"]["mean_abs_dlogprob"] == pytest.approx(0.1)
    assert custom["perplexity"] == pytest.approx(2 * math.exp(0.1))
    assert "exit 1" in rows["vLLM fp8_per_block weights (at load)"]["error"]
    assert all(spec["eager"] and spec["prefill_chunk"] == 128 and spec["gpu_share"] == parallel for spec in calls)


def test_checkpoints_only_keeps_the_reference_row(tiny_model, tmp_path, monkeypatch):  # noqa: F811
    (tiny_model / "heldout.txt").write_text("def add(a, b):\n    return a + b\n" * 20)
    checkpoint = write_config(tmp_path / "nvfp4", {"config_groups": {"g": {"weights": {"num_bits": 4}}}})
    monkeypatch.setattr(engine_eval, "score_in_subprocess",
                        lambda spec: [Position(t, -1.0, {}) for w in spec["windows"] for t in w[1:]])
    report = engine_eval.main(["--engine", "sglang", "--model", str(tiny_model), "--checkpoint", f"nvfp4={checkpoint}",
                               "--checkpoints-only", "--window", "16", "--out", str(tmp_path / "eval.json")])
    assert [row["label"] for row in report["rows"]] == ["triton, bf16", "nvfp4: stock sglang"]
    assert report["rows"][1]["model"] == checkpoint and report["rows"][1]["agreement"]["max_abs_dlogprob"] == 0
