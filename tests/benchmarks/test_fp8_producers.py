"""The producer benchmark's pieces that need no GPU: latentspeed's side against the reference at a
small width (Triton's interpreter), and the names it calls in vLLM 0.26.0."""

import pytest
import torch

from benchmarks import fp8_producers


@pytest.mark.parametrize("producer", ["add_rms_norm", "rms_norm", "silu_mul"])
def test_latentspeed_side_matches_the_reference(producer):
    width, tokens = 256, 3
    x = torch.randn(tokens, 2 * width if producer == "silu_mul" else width, dtype=torch.bfloat16)
    weight = (torch.rand(width) + 0.5).bfloat16()
    residual = torch.randn(tokens, width, dtype=torch.bfloat16)
    expected, ours = fp8_producers.latentspeed_provider(producer, x, weight, residual)
    got = fp8_producers.dequantized(*ours())
    reference = fp8_producers.dequantized(*expected)
    assert got.shape == reference.shape == (tokens, width)
    assert ((got - reference).norm() / reference.norm()).item() < 0.01
    assert fp8_producers.fused_bytes(producer, tokens, width) > tokens * width


@pytest.mark.parametrize("producer", ["add_rms_norm", "rms_norm", "silu_mul"])
def test_guarded_side_counts_into_the_stats(producer):
    """``latentspeed-guarded`` times the call the engines make with the fp8 guard on: one planted NaN is
    counted (in a norm's row every value turns NaN)."""
    width, tokens = 256, 3
    x = torch.randn(tokens, 2 * width if producer == "silu_mul" else width, dtype=torch.bfloat16)
    x[1, width + 5 if producer == "silu_mul" else 5] = float("nan")
    stats = torch.zeros(2, dtype=torch.int32)
    _, guarded = fp8_producers.latentspeed_provider(producer, x, (torch.rand(width) + 0.5).bfloat16(),
                                                    torch.randn(tokens, width, dtype=torch.bfloat16), stats)
    guarded()
    assert stats.tolist() == [0, 1 if producer == "silu_mul" else width]


def test_the_vllm_kernels_it_times_exist():
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.quantization.utils import fp8_utils

    for name in ("rms_norm", "fused_add_rms_norm", "rms_norm_per_block_quant", "silu_and_mul_per_block_quant"):
        assert callable(getattr(ops, name)), name
    assert callable(fp8_utils.per_token_group_quant_fp8)
    providers = fp8_producers.vllm_providers("silu_mul", torch.zeros(2, 256, dtype=torch.bfloat16), None, None)
    assert set(providers) == {"vLLM-fused", "vLLM-unfused", "latentspeed-unfused"}
