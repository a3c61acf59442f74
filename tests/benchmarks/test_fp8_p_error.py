"""``benchmarks.fp8_p_error``: rounding ``P`` to the cache's fp8 format adds a bounded, nonzero error,
larger in E5M2 (2 mantissa bits) than in E4M3 (3)."""

import pytest

from benchmarks import fp8_p_error


@pytest.mark.parametrize("cache, p_bound", [("e4m3", 5e-2), ("e5m2", 1e-1)])
def test_p_rounding_adds_a_percent_level_error(cache, p_bound):
    row = fp8_p_error.errors(batch=1, heads=4, ctx=512, sharpen=1.0, cache=cache)
    assert 1e-3 < row["p_only"] < p_bound  # about 2**-(mantissa bits + 2) per element
    assert row["e4m3_queries_and_p"] > row["e4m3_queries"] > 0
    against_bf16 = row["vs_bf16_cache"]  # each rounding adds to the fp8 cache's own error
    assert against_bf16["cache_queries_and_p"] > against_bf16["cache_and_queries"] > against_bf16["cache"] > 1e-3


def test_e5m2_p_costs_more_than_e4m3_p():
    rows = {cache: fp8_p_error.errors(batch=1, heads=4, ctx=512, sharpen=1.0, cache=cache)
            for cache in ("e4m3", "e5m2")}
    assert rows["e5m2"]["p_only"] > 1.5 * rows["e4m3"]["p_only"]
