"""Fixes for Triton's CPU interpreter, applied when ``TRITON_INTERPRET=1``.

Triton 3.6's interpreter stores bf16 tensors as raw uint16, and

- ``tl.dot`` then multiplies those integers, so every bf16 dot returns garbage (values near
  1e10 for unit-scale inputs). Widening bf16 operands to fp32 first is exact and matches what
  the GPU's bf16 MMA computes.
- fp32 -> bf16 casts truncate, where the GPU rounds to nearest even: every other value lands one
  bf16 ulp off, which a later fp8 quantization turns into percent-level differences.

and it rounds otherwise than the GPU:

- fp32 -> fp8 casts round ties away from zero and can lose the carry into the exponent (-7.97
  becomes -4 in E4M3), where Hopper's ``cvt.rn.satfinite`` rounds to nearest even and saturates at
  the format's largest finite value.
- ``tl.math.fma`` rounds the product and then the sum, where the GPU's is fused (one rounding):
  a division's remainder ``fma(-q, b, a)`` comes out wrong.

Kernel code is unchanged; only the interpreter's dot, narrowing casts and fma are wrapped. Remove
once Triton's interpreter handles them (it does not as of 3.6.0).
"""

import numpy as np
import torch
import triton.language as tl
from triton.runtime import interpreter

_original_create_dot = interpreter.InterpreterBuilder.create_dot


def _widen_bf16(handle):
    if handle.dtype.scalar != tl.bfloat16:
        return handle
    bits = handle.data.astype(np.uint32) << 16
    return interpreter.TensorHandle(bits.view(np.float32), tl.float32)


def _create_dot_bf16_as_fp32(self, a, b, d, input_precision, max_num_imprecise_acc):
    return _original_create_dot(self, _widen_bf16(a), _widen_bf16(b), d, input_precision, max_num_imprecise_acc)


_original_fp_trunc = interpreter.InterpreterBuilder.create_fp_trunc


def _fp_trunc_to_nearest(self, src, dst_type):
    if src.dtype.scalar != tl.float32 or dst_type.scalar != tl.bfloat16:
        return _original_fp_trunc(self, src, dst_type)
    # bf16 keeps the top 16 bits: add half an ulp (ties to even) before dropping the rest; NaN stays NaN.
    bits = np.ascontiguousarray(src.data).view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    rounded = np.where(np.isnan(src.data), np.uint16(0x7FC0), rounded)
    return interpreter.TensorHandle(rounded, tl.bfloat16)


_original_fp_to_fp = interpreter.InterpreterBuilder.create_fp_to_fp
_FP8_TYPES = {tl.float8e4nv: torch.float8_e4m3fn, tl.float8e5: torch.float8_e5m2}


def _fp32_to_fp8_as_hopper(self, src, dst_type, rounding_mode):
    fp8 = _FP8_TYPES.get(dst_type.scalar)
    if src.dtype.scalar != tl.float32 or fp8 is None:
        return _original_fp_to_fp(self, src, dst_type, rounding_mode)
    # torch rounds to nearest even; saturating first (NaN stays NaN) is what satfinite adds.
    largest = torch.finfo(fp8).max
    values = torch.from_numpy(np.clip(np.ascontiguousarray(src.data, dtype=np.float32), -largest, largest))
    return interpreter.TensorHandle(values.to(fp8).view(torch.uint8).numpy(), dst_type.scalar)


_original_create_fma = interpreter.InterpreterBuilder.create_fma


def _fused_fma(self, x, y, z):
    if z.dtype.scalar != tl.float32:
        return _original_create_fma(self, x, y, z)
    # The fp32 product is exact in fp64. Adding with round-to-odd (the nearest fp64 sum, moved
    # toward zero and given an odd last bit when inexact) and then rounding to fp32 rounds once.
    product = x.data.astype(np.float64) * y.data.astype(np.float64)
    addend = z.data.astype(np.float64)
    total = product + addend
    back = total - product
    error = (product - (total - back)) + (addend - back)
    bits = total.view(np.int64).copy()
    inexact = np.isfinite(total) & (error != 0)
    bits[inexact & (np.sign(error) != np.sign(total)) & (total != 0)] -= 1
    bits[inexact] |= 1
    return interpreter.TensorHandle(bits.view(np.float64).astype(np.float32), tl.float32)


def patch_interpreter() -> None:
    interpreter.InterpreterBuilder.create_dot = _create_dot_bf16_as_fp32
    interpreter.InterpreterBuilder.create_fp_trunc = _fp_trunc_to_nearest
    interpreter.InterpreterBuilder.create_fp_to_fp = _fp32_to_fp8_as_hopper
    interpreter.InterpreterBuilder.create_fma = _fused_fma
