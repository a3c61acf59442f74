"""Which fp8 GEMM configurations the kernels cover; engine adapters ask here."""

import torch

from ..fp8_format import FP8_DTYPES
from .gemm import SCALE_BLOCK

MIN_CAPABILITY = (8, 9)  # fp8 tensor-core dots


def is_supported(
    *, weight_block: tuple[int, int], activation_group: int, fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    capability: tuple[int, int] | None = None,
) -> tuple[bool, str]:
    """``(True, "")`` when the block-scaled GEMM covers this scheme, else ``(False, reason)``."""
    if tuple(weight_block) != (SCALE_BLOCK, SCALE_BLOCK):
        return False, f"weight block {list(weight_block)} is not supported: [{SCALE_BLOCK}, {SCALE_BLOCK}] is"
    if activation_group != SCALE_BLOCK:
        return False, f"activation group {activation_group} is not supported: {SCALE_BLOCK} is"
    if fp8_dtype not in FP8_DTYPES:
        return False, f"{fp8_dtype} is not an fp8 dtype"
    if capability is not None and tuple(capability) < MIN_CAPABILITY:
        return False, f"fp8 GEMMs need compute capability 8.9 or newer (this GPU has {capability[0]}.{capability[1]})"
    return True, ""
