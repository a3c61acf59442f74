"""The warm-up cost benchmark's MoE timing without a GPU (Triton's interpreter, a small shape)."""

import torch

from benchmarks import fp8_warmup_cost


def test_moe_launch_times_runs_each_size_once_slowest_first():
    weights = fp8_warmup_cost.moe_weights(experts=4, hidden=128, inter=128, device="cpu")
    assert [tuple(w.shape) for w in weights] == [(4, 256, 128), (4, 2, 1), (4, 128, 128), (4, 1, 1)]
    rows = fp8_warmup_cost.moe_launch_times(weights, top_k=2, max_tokens=3)
    assert sorted(row["tokens"] for row in rows) == [1, 2, 3]
    assert [row["total_s"] for row in rows] == sorted((row["total_s"] for row in rows), reverse=True)
    assert all(0 < row["host_s"] <= row["total_s"] for row in rows)
    assert weights[0].dtype == weights[2].dtype == torch.float8_e4m3fn
