"""The two OCP fp8 formats, and rounding onto their grids inside Triton kernels.

``round_to_fp8_grid`` rounds fp32 values to the nearest fp8 value (ties to even, subnormals
included) while still in fp32, so the cast that follows is exact. Hardware casts on Hopper
round the same way; Triton's CPU interpreter does not (it rounds ties away from zero and can
lose the carry into the exponent, e.g. -7.97 -> -4 in E4M3), and kernels are tested there.
"""

import torch
import triton
import triton.language as tl

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def fp8_grid(dtype: torch.dtype) -> tuple[int, int, float]:
    """``(mantissa bits, smallest normal exponent, largest finite value)`` of an fp8 dtype."""
    if dtype == torch.float8_e4m3fn:
        return 3, -6, 448.0
    if dtype == torch.float8_e5m2:
        return 2, -14, 57344.0
    raise ValueError(f"{dtype} is not an fp8 dtype: float8_e4m3fn or float8_e5m2 is")


@triton.jit
def round_to_fp8_grid(y, MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr):
    """``y`` (fp32, already clamped to the format's range) rounded to the fp8 grid; values that
    round to zero keep their sign, as the hardware cast does."""
    magnitude = tl.abs(y)
    bits = magnitude.to(tl.int32, bitcast=True)
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, MIN_EXP)
    ulp = ((exponent - MANT_BITS + 127) << 23).to(tl.float32, bitcast=True)  # 2^(exponent - MANT_BITS)
    # Adding and subtracting 1.5 * 2^23 rounds an fp32 of magnitude < 2^22 to an integer, ties to even.
    magic = 12582912.0
    rounded = ((magnitude / ulp + magic) - magic) * ulp
    # Copy the sign bit (not `-x`, which Triton computes as 0 - x and so loses it on zero).
    sign = y.to(tl.int32, bitcast=True) & -2147483648
    return (rounded.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
