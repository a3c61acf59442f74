"""``latentspeed eval``: the accuracy arithmetic on known inputs, and its input checks."""

import math
import subprocess
import sys

import pytest

from latentspeed.evaluate import load_windows, require_engine
from latentspeed.metrics import Position, agreement, perplexity


def test_perplexity_of_known_logprobs():
    positions = [Position(1, math.log(0.5), {}), Position(2, math.log(0.25), {})]
    assert perplexity(positions) == pytest.approx(math.sqrt(8))  # exp(-(ln .5 + ln .25) / 2)
    with pytest.raises(ValueError, match="no scored positions"):
        perplexity([])


def test_agreement_of_known_runs():
    ln = math.log
    reference = [Position(5, ln(0.5), {5: ln(0.5), 6: ln(0.3), 7: ln(0.2)}), Position(6, ln(0.9), {6: ln(0.9), 1: ln(0.1)})]
    test = [Position(5, ln(0.4), {5: ln(0.4), 6: ln(0.4), 7: ln(0.2)}), Position(6, ln(0.9), {1: ln(0.9), 6: ln(0.1)})]
    result = agreement(reference, test)
    assert result["mean_abs_dlogprob"] == pytest.approx((ln(0.5) - ln(0.4)) / 2)
    assert result["max_abs_dlogprob"] == pytest.approx(ln(0.5) - ln(0.4))
    # argmax ties (5 and 6 at 0.4) resolve to the first listed token: position 0 agrees, 1 does not.
    assert result["top1_agreement"] == 0.5
    kl0 = 0.5 * ln(0.5 / 0.4) + 0.3 * ln(0.3 / 0.4) + 0.2 * ln(0.2 / 0.2)
    kl1 = 0.9 * ln(0.9 / 0.1) + 0.1 * ln(0.1 / 0.9)
    assert result["kl_topk"] == pytest.approx((kl0 + kl1) / 2)
    assert result["kl_positions"] == 2


def test_agreement_skips_kl_where_the_test_run_lacks_a_token_and_refuses_mismatched_runs():
    reference = [Position(3, -1.0, {3: -1.0, 4: -2.0})]
    assert agreement(reference, [Position(3, -1.5, {3: -1.5, 9: -0.5})])["kl_positions"] == 0
    with pytest.raises(ValueError, match="different tokens"):
        agreement(reference, [Position(4, -1.0, {})])
    with pytest.raises(ValueError, match="different positions"):
        agreement(reference, [])


@pytest.fixture
def tiny_model(tmp_path):
    from benchmarks.reference_model.model_config import deepseek_v3_config
    from benchmarks.reference_model.tokenizer import save_tokenizer, train_tokenizer

    model = tmp_path / "model"
    model.mkdir()
    tokenizer = train_tokenizer(["def add(a, b):\n    return a + b\n" * 50], vocab_size=300)
    save_tokenizer(tokenizer, model, 512)
    deepseek_v3_config(tokenizer.get_vocab_size(), 64, hidden_size=64, num_hidden_layers=2).save_pretrained(model)
    return model


def test_windows_cover_the_text(tiny_model, tmp_path):
    text = tmp_path / "heldout.txt"
    text.write_text("def add(a, b):\n    return a + b\n" * 30)
    windows = load_windows(str(tiny_model), str(text), window=16, max_windows=100)
    assert all(2 <= len(w) <= 16 for w in windows) and len(windows) > 3
    assert len(load_windows(str(tiny_model), str(text), window=16, max_windows=2)) == 2


@pytest.mark.parametrize(
    "setup, message",
    [
        ("no_config", "is not a model directory"),
        ("bad_config", "is not loadable"),
        ("missing_text", "does not exist"),
        ("empty_text", "is empty"),
        ("latin1_text", "is not UTF-8"),
    ],
)
def test_bad_inputs_are_named(tiny_model, tmp_path, setup, message):
    model, text = tiny_model, tmp_path / "t.txt"
    text.write_text("hello world " * 10)
    if setup == "no_config":
        model = tmp_path
    elif setup == "bad_config":
        (tiny_model / "config.json").write_text("{not json")
    elif setup == "missing_text":
        text = tmp_path / "absent.txt"
    elif setup == "empty_text":
        text.write_text("  \n")
    elif setup == "latin1_text":
        text.write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(ValueError, match=message):
        load_windows(str(model), str(text), window=16, max_windows=4)


def test_missing_engine_is_named():
    pytest.importorskip("vllm")
    if sys.modules.get("sglang") or __import__("importlib").util.find_spec("sglang"):
        pytest.skip("SGLang is installed here")
    with pytest.raises(ValueError, match="sglang is not installed"):
        require_engine("sglang")


def test_cli_reports_input_errors_without_a_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "latentspeed", "eval", "--model", str(tmp_path), "--text", str(tmp_path / "x.txt")],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2
    assert "latentspeed eval:" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("share", [1, 4])
def test_vllm_arguments_are_engine_args(share):
    """Every argument a scoring run gives ``vllm.LLM`` is one of vLLM's engine arguments."""
    from dataclasses import fields

    from vllm.engine.arg_utils import EngineArgs

    from latentspeed.evaluate import vllm_kwargs

    spec = dict(model="m", kv_cache_dtype="fp8", quantization=None, attention_backend="CUSTOM", windows=[[1] * 512],
                eager=True, prefill_chunk=128, gpu_share=share)
    kwargs = vllm_kwargs(spec, 140 * 2**30)
    assert set(kwargs) <= {f.name for f in fields(EngineArgs)}
    assert kwargs["attention_config"] == {"backend": "CUSTOM", "mla_prefill_backend": "CUSTOM"}
    assert ("kv_cache_memory_bytes" in kwargs) == (share > 1)
    if share > 1:
        assert kwargs["kv_cache_memory_bytes"] == 14 * 2**30 and kwargs["gpu_memory_utilization"] == pytest.approx(0.225)
