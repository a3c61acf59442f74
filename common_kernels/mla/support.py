"""Which MLA configurations the kernels cover; both engine adapters ask here."""

import torch

from ..fp8_format import FP8_DTYPES
from .cache import HALF_DTYPES
from .prefill import split_head_dim

SUPPORTED_BLOCK_SIZES = (16, 32, 64)
MIN_CAPABILITY = (8, 0)
MIN_FP8_CAPABILITY = (8, 9)


def _pow2_in(value: int, low: int, high: int) -> bool:
    return low <= value <= high and value & (value - 1) == 0


def is_supported(
    *,
    num_heads: int,
    kv_lora_rank: int,
    qk_nope_head_dim: int,
    qk_rope_head_dim: int,
    v_head_dim: int,
    dtype: torch.dtype,
    cache_dtype: torch.dtype,
    block_size: int | None = None,
    capability: tuple[int, int] | None = None,
) -> tuple[bool, str]:
    """``(True, "")`` when the decode, cache-write and prefill kernels cover this MLA layer,
    else ``(False, reason)`` with the reason naming the offending value and the limit.

    ``capability`` is the GPU's ``(major, minor)``; ``None`` skips the hardware checks.
    ``block_size`` ``None`` skips the page-size check.
    """
    if num_heads < 1:
        return False, f"num_heads={num_heads}: at least one head is needed"
    if not _pow2_in(kv_lora_rank, 16, 1024):
        return False, f"kv_lora_rank={kv_lora_rank} is not supported: a power of two from 16 to 1024 is"
    if not _pow2_in(qk_rope_head_dim, 16, 1024):
        return False, f"qk_rope_head_dim={qk_rope_head_dim} is not supported: a power of two from 16 to 1024 is"
    try:
        split_head_dim(qk_nope_head_dim + qk_rope_head_dim)
    except ValueError as err:
        return False, f"prefill: {err}"
    if not _pow2_in(v_head_dim, 16, 1024):
        return False, f"v_head_dim={v_head_dim} is not supported: a power of two from 16 to 1024 is"
    if dtype not in HALF_DTYPES:
        return False, f"model dtype {dtype} is not supported: bfloat16 or float16 is"
    if cache_dtype not in FP8_DTYPES and cache_dtype != dtype:
        return False, f"kv-cache dtype {cache_dtype} is not supported with model dtype {dtype}"
    if block_size is not None and block_size not in SUPPORTED_BLOCK_SIZES:
        return False, f"block size {block_size} is not supported: one of {SUPPORTED_BLOCK_SIZES} is"
    if capability is not None:
        if tuple(capability) < MIN_CAPABILITY:
            return False, f"compute capability {capability[0]}.{capability[1]} is too old: 8.0 or newer is needed"
        if cache_dtype in FP8_DTYPES and tuple(capability) < MIN_FP8_CAPABILITY:
            return False, (
                f"an fp8 kv-cache needs compute capability 8.9 or newer (this GPU has "
                f"{capability[0]}.{capability[1]}); use a bfloat16 cache"
            )
    return True, ""
