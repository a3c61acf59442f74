"""The block-FP8 GEMM tuner's candidates for small M (it runs on the GPU only; these are its choices)."""

import pytest
import torch

from benchmarks.tune_fp8_gemm import SWAP_BELOW_BLOCK_M, candidates
from common_kernels.fp8 import gemm_sm90_ws


@pytest.mark.parametrize("m", [1, 16, 32])
def test_short_tiles_are_also_tried_as_swapped_products(m):
    configs = list(candidates(m, 7168))
    plain = [c for c in configs if not c.get("SWAP_AB")]
    swapped = [c for c in configs if c.get("SWAP_AB")]
    expected = [dict(c, SWAP_AB=True) for c in plain if c["BLOCK_M"] < SWAP_BELOW_BLOCK_M and c["BLOCK_N"] >= 64]
    assert swapped == expected and swapped  # each short tile of 64 columns or more, once swapped
    assert all(c["BLOCK_M"] >= m or c["BLOCK_M"] == 64 for c in configs)


def test_tiles_of_64_rows_are_not_swapped():
    assert not any(c.get("SWAP_AB") for c in candidates(64, 7168))


@pytest.mark.parametrize("m, k, splits", [(128, 7168, {2, 3, 4, 8, 16}), (64, 512, {2}), (1024, 7168, set()),
                                          (32, 7168, set())])
def test_ws_k_splits_are_tried_on_hopper_at_small_m(monkeypatch, m, k, splits):
    """The warp-specialized kernel's K splits from M = 64 to 512, each split at least two K blocks; every
    candidate a launch that kernel takes."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args: (9, 0))
    ws = [c for c in candidates(m, k) if c.get("KERNEL") == "sm90_ws"]
    assert {c["SPLIT_K"] for c in ws if c["SPLIT_K"] > 1} == splits
    for config in ws:
        assert gemm_sm90_ws.fits(config) and gemm_sm90_ws.splits_fit(k, config["SPLIT_K"])
        assert -(-k // 128) // config["SPLIT_K"] >= 2
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args: (8, 0))
    assert not any(c.get("KERNEL") for c in candidates(m, k))
