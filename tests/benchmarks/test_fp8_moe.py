"""``benchmarks.fp8_moe``' vLLM rows are assembled from the real vLLM's FP8 MoE oracle (the runs are GPU
work; here the assembly alone, on the CPU)."""

import pytest
import torch

pytest.importorskip("vllm")

from benchmarks.fp8_moe import vllm_oracle_kernel  # noqa: E402


def test_the_oracle_assembles_the_backend_asked_for():
    experts, top_k, hidden, inter = 4, 2, 256, 128
    w13 = torch.randn(experts, 2 * inter, hidden).to(torch.float8_e4m3fn)
    w2 = torch.randn(experts, hidden, inter).to(torch.float8_e4m3fn)
    s13, s2 = torch.rand(experts, 2 * inter // 128, hidden // 128), torch.rand(experts, hidden // 128, inter // 128)
    x = torch.randn(8, hidden, dtype=torch.bfloat16)
    weights, ids = torch.rand(8, top_k), torch.randint(0, experts, (8, top_k), dtype=torch.int32)
    run, served_by = vllm_oracle_kernel("TRITON", x, w13, s13, w2, s2, weights, ids)
    assert callable(run) and served_by == "TritonExperts"
    with pytest.raises(KeyError):
        vllm_oracle_kernel("NO_SUCH_BACKEND", x, w13, s13, w2, s2, weights, ids)
