"""The fused MoE tuner's candidates (it runs on the GPU only; these are its choices)."""

from benchmarks.tune_fp8_moe import CAPPED_FROM_TOKENS, GEMM_LAUNCHES, gemm_launches


def test_register_caps_are_tried_from_many_tokens_on():
    assert list(gemm_launches(CAPPED_FROM_TOKENS - 1)) == GEMM_LAUNCHES
    launches = list(gemm_launches(CAPPED_FROM_TOKENS))
    capped = launches[len(GEMM_LAUNCHES):]
    assert launches[:len(GEMM_LAUNCHES)] == GEMM_LAUNCHES and len(capped) == 4
    for launch in capped:  # three programs of 4 warps a multiprocessor, or two of 8
        assert launch["BLOCK_N"] == 128 and launch["num_stages"] <= 3
        assert launch["maxnreg"] == {4: 168, 8: 128}[launch["num_warps"]]
