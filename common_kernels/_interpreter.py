"""A fix for Triton's CPU interpreter, applied when ``TRITON_INTERPRET=1``.

Triton 3.6's interpreter stores bf16 tensors as raw uint16 and ``tl.dot`` then multiplies
those integers, so every bf16 dot returns garbage (values near 1e10 for unit-scale inputs).
Widening bf16 operands to fp32 first is exact and matches what the GPU's bf16 MMA computes.
Kernel code is unchanged; only the interpreter's dot is wrapped. Remove once Triton's
interpreter handles bf16 dots (it does not as of 3.6.0).
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


def patch_interpreter() -> None:
    interpreter.InterpreterBuilder.create_dot = _create_dot_bf16_as_fp32
