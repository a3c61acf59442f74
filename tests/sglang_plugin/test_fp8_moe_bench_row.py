"""``benchmarks.fp8_moe``'s SGLang row calls the real SGLang 0.5.17's Triton ``fused_experts`` (the run is GPU
work; here the call is assembled and its arguments bound to that function's signature, on the CPU)."""

import inspect

import torch

from benchmarks.fp8_moe import sglang_fused


def test_the_sglang_row_calls_fused_experts_as_its_signature_takes(monkeypatch):
    from sglang.srt.layers.moe.moe_runner.triton_utils import fused_moe

    real = inspect.signature(fused_moe.fused_experts)
    calls = []
    monkeypatch.setattr(fused_moe, "fused_experts", lambda *args, **kwargs: calls.append(real.bind(*args, **kwargs)))
    experts, top_k, hidden, inter = 4, 2, 256, 128
    w13 = torch.randn(experts, 2 * inter, hidden).to(torch.float8_e4m3fn)
    w2 = torch.randn(experts, hidden, inter).to(torch.float8_e4m3fn)
    s13, s2 = torch.rand(experts, 2, 2), torch.rand(experts, 2, 1)
    x = torch.randn(8, hidden, dtype=torch.bfloat16)
    weights, ids = torch.rand(8, top_k), torch.randint(0, experts, (8, top_k), dtype=torch.int32)
    sglang_fused(x, w13, s13, w2, s2, weights, ids)()
    bound, = calls
    args = bound.arguments
    assert args["use_fp8_w8a8"] and args["block_shape"] == [128, 128]
    assert args["w1"] is w13 and args["w2"] is w2 and args["w1_scale"] is s13 and args["w2_scale"] is s2
    config = args["moe_runner_config"]
    assert (config.num_experts, config.top_k, config.intermediate_size_per_partition) == (experts, top_k, inter)
    assert not config.gate_up_interleaved  # W13 is [gate; up], as DeepSeek-V3's checkpoints hold it
    assert args["topk_output"].topk_ids is ids and args["topk_output"].topk_weights is weights
