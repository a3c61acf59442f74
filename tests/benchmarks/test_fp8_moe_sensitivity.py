"""benchmarks/fp8_moe_sensitivity.py on the CPU: no move gives no error, a move of 1e-2 gives the
re-quantization's error, and the reference's GEMM is put back afterwards."""

from benchmarks.fp8_moe_sensitivity import sensitivity
from common_kernels.fp8 import reference


def test_unperturbed_sums_give_the_reference_exactly():
    result = sensitivity(0.0, cases=3)
    assert result["max_rel_rms"] == 0 and result["fraction_failing_elementwise_2e-2"] == 0


def test_moved_sums_move_the_output_and_the_reference_is_restored():
    exact = reference.block_scaled_gemm_ref
    result = sensitivity(1e-2, cases=4)
    assert reference.block_scaled_gemm_ref is exact
    assert 1e-3 < result["median_rel_rms"] < 1e-1
