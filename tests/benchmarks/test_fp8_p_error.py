"""``benchmarks.fp8_p_error``: rounding ``P`` to E4M3 adds a bounded, nonzero error."""

from benchmarks import fp8_p_error


def test_p_rounding_adds_a_percent_level_error():
    row = fp8_p_error.errors(batch=1, heads=4, ctx=512, sharpen=1.0)
    assert 1e-3 < row["e4m3_p_only"] < 5e-2  # E4M3 keeps 3 mantissa bits: about 2**-5 per element
    assert row["e4m3_queries_and_p"] > row["e4m3_queries"] > 0
    against_bf16 = row["vs_bf16_cache"]  # each rounding adds to the E4M3 cache's own error
    assert (against_bf16["e4m3_cache_queries_and_p"] > against_bf16["e4m3_cache_and_queries"]
            > against_bf16["e4m3_cache"])
    assert against_bf16["e4m3_cache"] > 1e-3
