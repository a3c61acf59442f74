"""Fixes for Triton's CPU interpreter, applied when ``TRITON_INTERPRET=1``.

Triton 3.6's interpreter stores bf16 tensors as raw uint16, and

- ``tl.dot`` then multiplies those integers, so every bf16 dot returns garbage (values near
  1e10 for unit-scale inputs). Widening bf16 operands to fp32 first is exact and matches what
  the GPU's bf16 MMA computes.
- fp32 -> bf16 casts truncate, where the GPU rounds to nearest even: every other value lands one
  bf16 ulp off, which a later fp8 quantization turns into percent-level differences.

Kernel code is unchanged; only the interpreter's dot and narrowing cast are wrapped. Remove once
Triton's interpreter handles both (it does not as of 3.6.0).
"""

import numpy as np
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


def patch_interpreter() -> None:
    interpreter.InterpreterBuilder.create_dot = _create_dot_bf16_as_fp32
    interpreter.InterpreterBuilder.create_fp_trunc = _fp_trunc_to_nearest
