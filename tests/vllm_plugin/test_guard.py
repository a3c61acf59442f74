"""The fp8 guard's step in vLLM 0.26.0 (``vllm_plugin/guard.py``): vLLM loads the logits-processor
entry point into a generating engine, and its own input batch steps latentspeed's guards on every
refresh (once per engine step), whatever the attention backend."""

import importlib.metadata

import pytest
import torch
import vllm.utils.torch_utils
import vllm.v1.worker.gpu_input_batch
from vllm.config import DeviceConfig, VllmConfig
from vllm.v1.sample.logits_processor import build_logitsprocs
from vllm.v1.worker.gpu_input_batch import InputBatch

import common_kernels.guard
from common_kernels.guard import Fp8NumericsError, fp8_guard
from vllm_plugin.guard import Fp8GuardStep, steps_every_engine_step


@pytest.fixture
def input_batch(monkeypatch):
    """A CPU input batch with the logits processors vLLM builds for a generating engine."""
    for module in (vllm.utils.torch_utils, vllm.v1.worker.gpu_input_batch):
        monkeypatch.setattr(module, "PIN_MEMORY", False)  # no CUDA driver to pin with
    monkeypatch.setattr(common_kernels.guard, "_GUARDS", {})  # guards made here read this test's mode
    config = VllmConfig(device_config=DeviceConfig("cpu"))
    assert steps_every_engine_step(config)
    processors = build_logitsprocs(config, torch.device("cpu"), False, False)
    return InputBatch(max_num_reqs=4, max_model_len=64, max_num_batched_tokens=64, device=torch.device("cpu"),
                      vocab_size=32, block_sizes=[16], kernel_block_sizes=[16], max_num_blocks_per_req=[4],
                      logitsprocs=processors)


def test_the_entry_point_is_installed():
    found = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="vllm.logits_processors")}
    assert found.get("latentspeed_fp8_guard") == "vllm_plugin.guard:Fp8GuardStep"


def test_vllm_builds_it_into_a_generating_engine(input_batch):
    steps = [p for p in input_batch.logitsprocs.all if isinstance(p, Fp8GuardStep)]
    assert len(steps) == 1
    logits = torch.randn(3, 32)
    assert torch.equal(steps[0].apply(logits.clone()), logits) and steps[0].is_argmax_invariant()


@pytest.mark.parametrize("planted", [(5, 0), (0, 2)])
def test_raise_stops_the_engine_step_that_reads_the_counters(monkeypatch, input_batch, planted):
    monkeypatch.setenv("LATENTSPEED_FP8_GUARD", "raise")
    guard = fp8_guard("cpu")
    guard.counters += torch.tensor(planted, dtype=guard.counters.dtype)  # as a quantizer would count them
    for _ in range(guard.check_every - 1):
        input_batch.refresh_metadata()
    with pytest.raises(Fp8NumericsError, match=rf"{planted[0]} values clamped .* and {planted[1]} non-finite"):
        input_batch.refresh_metadata()


def test_warn_logs_once_and_goes_on(monkeypatch, input_batch, caplog):
    monkeypatch.setenv("LATENTSPEED_FP8_GUARD", "warn")
    guard = fp8_guard("cpu")
    guard.counters[0] += 7
    with caplog.at_level("WARNING", logger="latentspeed"):
        for _ in range(3 * guard.check_every):
            input_batch.refresh_metadata()
    assert len(caplog.records) == 1 and "7 values clamped at the fp8 maximum" in caplog.records[0].getMessage()
