"""``benchmarks.fp8_moe_gemms``' row map for DeepGEMM's grouped GEMM (the benchmark runs on the GPU only)."""

import torch

from benchmarks.fp8_moe_gemms import row_experts
from common_kernels.fp8.moe import align_by_expert


def test_row_experts_name_each_real_row_and_mark_the_rest():
    """Each sorted row of a pair carries its pair's expert; padding rows and the rows past the runs -1."""
    ids = torch.tensor([[0, 3], [3, 1], [0, 3], [2, -1]], dtype=torch.int32)
    runs = align_by_expert(ids, 5, 16)
    experts = row_experts(runs, ids.numel())
    assert experts.shape == runs.sorted_ids.shape and experts.dtype == torch.int32
    real = runs.sorted_ids < ids.numel()
    assert torch.equal(experts[real], ids.flatten()[runs.sorted_ids[real].long()])
    assert (experts[~real] == -1).all() and int(real.sum()) == 7
