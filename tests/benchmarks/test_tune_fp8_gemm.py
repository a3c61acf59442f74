"""The block-FP8 GEMM tuner's candidates for small M (it runs on the GPU only; these are its choices)."""

import pytest

from benchmarks.tune_fp8_gemm import SWAP_BELOW_BLOCK_M, candidates


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
