"""Write latent rows into the paged MLA cache, quantizing to fp8 where the cache is fp8.

    cache[slot // B_page, slot % B_page, :] = [kv_c | k_pe]            (bf16 / fp16 cache)
    cache[slot // B_page, slot % B_page, :] = fp8(clamp([kv_c | k_pe] / s, -max, max))

Layout: ``kv_cache [N_blocks, B_page, D_latent + D_rope]``, one row per token: the
``D_latent`` normalized latent values, then the ``D_rope`` rotated key values, in the cache
dtype (the layout of vLLM's and SGLang's MLA caches: 576 values = 1152 bytes per token in
bf16, 576 bytes in fp8). ``s`` is one per-tensor fp32 scale. Values beyond the fp8 range
are clamped, and counted together with non-finite inputs when a stats buffer is given
(``common_kernels.guard``), so a bad scale shows instead of silently corrupting the cache.
"""

import torch
import triton
import triton.language as tl

from ..fp8_format import FP8_DTYPES, fp8_finite_max

HALF_DTYPES = (torch.bfloat16, torch.float16)


@triton.jit
def _write_latent_cache_kernel(
    kv_c_ptr,
    k_pe_ptr,
    cache_ptr,
    slot_ptr,
    scale_ptr,
    stats_ptr,
    stride_c_t,
    stride_pe_t,
    stride_cache_block,
    stride_cache_tok,
    D_LATENT: tl.constexpr,
    D_ROPE: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    IS_FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
    TRACK_STATS: tl.constexpr,
):
    tok = tl.program_id(0)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    valid = slot >= 0
    offs_c = tl.arange(0, D_LATENT)
    offs_pe = tl.arange(0, D_ROPE)
    kv_c = tl.load(kv_c_ptr + tok * stride_c_t + offs_c, mask=valid, other=0.0).to(tl.float32)
    k_pe = tl.load(k_pe_ptr + tok * stride_pe_t + offs_pe, mask=valid, other=0.0).to(tl.float32)
    slot = tl.maximum(slot, 0)
    row = cache_ptr + (slot // PAGE_SIZE) * stride_cache_block + (slot % PAGE_SIZE) * stride_cache_tok
    if IS_FP8:
        inv_scale = 1.0 / tl.load(scale_ptr)
        kv_c = kv_c * inv_scale
        k_pe = k_pe * inv_scale
        if TRACK_STATS:
            # NaN fails every comparison, so `x == x` is false exactly for NaN.
            nonfinite = tl.sum(((kv_c != kv_c) | (tl.abs(kv_c) == float("inf"))).to(tl.int32), 0)
            nonfinite += tl.sum(((k_pe != k_pe) | (tl.abs(k_pe) == float("inf"))).to(tl.int32), 0)
            saturated = tl.sum(((tl.abs(kv_c) > FP8_MAX) & (tl.abs(kv_c) != float("inf"))).to(tl.int32), 0)
            saturated += tl.sum(((tl.abs(k_pe) > FP8_MAX) & (tl.abs(k_pe) != float("inf"))).to(tl.int32), 0)
            tl.atomic_add(stats_ptr, saturated, mask=valid)
            tl.atomic_add(stats_ptr + 1, nonfinite, mask=valid)
        # Clamp (E4M3 has no infinity); the cast rounds to nearest even.
        kv_c = tl.minimum(tl.maximum(kv_c, -FP8_MAX), FP8_MAX)
        k_pe = tl.minimum(tl.maximum(k_pe, -FP8_MAX), FP8_MAX)
    tl.store(row + offs_c, kv_c.to(cache_ptr.dtype.element_ty), mask=valid)
    tl.store(row + D_LATENT + offs_pe, k_pe.to(cache_ptr.dtype.element_ty), mask=valid)


def _check_pow2(name: str, value: int) -> None:
    if value < 16 or value & (value - 1):
        raise ValueError(f"{name}={value} is not supported: it must be a power of two >= 16")


def write_latent_cache(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
    stats: torch.Tensor | None = None,
) -> None:
    """Store each token's latent row in the paged cache, in place.

    Args:
        kv_c: ``[T, D_latent]`` bf16/fp16, the normalized compressed KV; last dim contiguous.
        k_pe: ``[T, D_rope]`` or ``[T, 1, D_rope]``, same dtype, the rotated key.
        kv_cache: ``[N_blocks, B_page, D_latent + D_rope]`` in bf16, fp16,
            ``torch.float8_e4m3fn`` or ``torch.float8_e5m2`` (view a uint8 cache as one of
            these first); the last dim contiguous.
        slot_mapping: ``[T']`` int32/int64, ``block * B_page + offset``, ``T' <= T``: rows past
            ``T'`` are not written (CUDA-graph padding); a slot ``< 0`` skips its row.
        kv_scale: ``[1]`` fp32 dequantization scale, required for fp8 caches, ignored otherwise.
        stats: optional ``[2]`` int32 counters; fp8 caches add the number of values clamped at
            the fp8 maximum to ``stats[0]`` and of non-finite values to ``stats[1]``.

    Example::

        cache = torch.empty(n_blocks, 64, 576, dtype=torch.float8_e4m3fn, device="cuda")
        write_latent_cache(kv_c, k_pe, cache, slots, kv_scale=torch.ones(1, device="cuda"))
    """
    if k_pe.dim() == 3:
        k_pe = k_pe.squeeze(1)
    d_latent = kv_c.shape[-1]
    num_tokens = slot_mapping.shape[0]
    d_rope = k_pe.shape[-1]
    _check_pow2("D_latent", d_latent)
    _check_pow2("D_rope", d_rope)
    if kv_cache.dim() != 3 or kv_cache.shape[-1] != d_latent + d_rope:
        raise ValueError(
            f"kv_cache must be [num_blocks, block_size, {d_latent + d_rope}], got {tuple(kv_cache.shape)}"
        )
    if kv_c.dtype not in HALF_DTYPES or k_pe.dtype != kv_c.dtype:
        raise ValueError(f"kv_c/k_pe must share a bf16 or fp16 dtype, got {kv_c.dtype}/{k_pe.dtype}")
    is_fp8 = kv_cache.dtype in FP8_DTYPES
    if not is_fp8 and kv_cache.dtype != kv_c.dtype:
        raise ValueError(f"kv_cache dtype {kv_cache.dtype} must be fp8 or match the inputs ({kv_c.dtype})")
    if kv_c.shape[0] < num_tokens or k_pe.shape[0] < num_tokens:
        raise ValueError(f"slot_mapping has {num_tokens} entries but kv_c/k_pe only {kv_c.shape[0]}/{k_pe.shape[0]} rows")
    if is_fp8 and kv_scale is None:
        raise ValueError("an fp8 kv_cache needs kv_scale")
    if kv_c.stride(-1) != 1 or k_pe.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("kv_c, k_pe and kv_cache need a contiguous last dimension")
    if num_tokens == 0:
        return
    scale = kv_scale if kv_scale is not None else kv_c.new_ones(1, dtype=torch.float32)
    fp8_max = fp8_finite_max(kv_cache.dtype) if is_fp8 else 0.0
    _write_latent_cache_kernel[(num_tokens,)](
        kv_c,
        k_pe,
        kv_cache,
        slot_mapping,
        scale,
        stats if stats is not None else scale,
        kv_c.stride(0),
        k_pe.stride(0),
        kv_cache.stride(0),
        kv_cache.stride(1),
        D_LATENT=d_latent,
        D_ROPE=d_rope,
        PAGE_SIZE=kv_cache.shape[1],
        IS_FP8=is_fp8,
        FP8_MAX=fp8_max,
        TRACK_STATS=is_fp8 and stats is not None,
    )
