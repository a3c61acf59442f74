"""Variable-length multi-head attention for the MLA prefill path.

For each sequence ``s`` with ``L_q`` queries and ``L_k`` keys, head ``h`` and query ``i``::

    out[i, h] = softmax_j(scale * q[i, h] . k[j, h]) v[j, h],   j < L_k  (and j <= i + L_k - L_q if causal)
    lse[h, i] = log sum_j exp(scale * q[i, h] . k[j, h])

MLA prefill up-projects the latent cache into ordinary heads (DeepSeek-V3: ``D_qk = 192``
= 128 "nope" + 64 rope, ``D_v = 128``), so ``D_qk`` may be the sum of two powers of two:
the kernel takes the two parts as separate dot products instead of padding 192 to 256.
The causal mask is aligned to the bottom right, which covers both MLA prefill calls: new
tokens against themselves (``L_q == L_k``, causal) and new tokens against a chunk of cached
context (not causal). FlashAttention-2's tiling (Dao, 2023, arXiv:2307.08691).
"""

import functools
import os

import torch
import triton
import triton.language as tl

from .cache import HALF_DTYPES
from .softmax import finish_softmax, online_softmax_step

_LOG2E = 1.4426950408889634

# (BLOCK_M, BLOCK_N, num_warps, num_stages), fastest first. On an H100 128 x 64 with three stages was the fastest or
# level with the others at every case of benchmarks/mla_prefill.py (64 x 1k to 4 x 16k tokens, 16 and 128 heads;
# results/mla_prefill-configs-h100-2026-12-06-s42.md); the smaller ones are for GPUs with less shared memory.
_PREFILL_CONFIGS = ((128, 64, 8, 3), (128, 64, 8, 2), (64, 64, 4, 2), (64, 32, 4, 2))
_INTERPRETER_CONFIG = (16, 16, 4, 1)
# (causal, return_lse) of the engines' launches: new tokens alone, new tokens after a cached prefix (merged with it by
# the lse), a chunk of cached context
LAUNCH_VARIANTS = ((True, False), (True, True), (False, True))
_SHARED_MEMORY_SLACK = 1024  # bytes Triton adds to the tiles (barriers)


def shared_memory_needed(config: tuple[int, int, int, int], d_qk: int, d_v: int, element_size: int) -> int:
    """Bytes of shared memory a block of ``config`` takes: the query block stays resident, and each of
    ``num_stages`` stages holds a key and a value block."""
    block_m, block_n, _, num_stages = config
    return (block_m * d_qk + num_stages * block_n * (d_qk + d_v)) * element_size + _SHARED_MEMORY_SLACK


def prefill_config(d_qk: int, d_v: int, element_size: int, shared_memory: int) -> tuple[int, int, int, int]:
    """The fastest of ``_PREFILL_CONFIGS`` that fits in ``shared_memory`` bytes a block. Raises ``ValueError`` if
    none does."""
    for config in _PREFILL_CONFIGS:
        if shared_memory_needed(config, d_qk, d_v, element_size) <= shared_memory:
            return config
    raise ValueError(f"prefill with head sizes {d_qk}/{d_v} needs more shared memory a block than this GPU has "
                     f"({shared_memory} bytes)")


@functools.cache
def _shared_memory(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).shared_memory_per_block_optin


def launch_config(device: torch.device, d_qk: int, d_v: int, element_size: int) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` of ``varlen_attention`` on ``device`` (small blocks in the
    Triton interpreter)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return _INTERPRETER_CONFIG
    return prefill_config(d_qk, d_v, element_size, _shared_memory(device))


@triton.jit
def _attend_keys(acc, m_i, l_i, q_a, q_b, k_ptr, v_ptr, k_start, head, n0, offs_m, len_k, shift, qk_scale_log2,
                 stride_k_t, stride_k_h, stride_v_t, stride_v_h, D_A: tl.constexpr, D_B: tl.constexpr,
                 D_V: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr, BLOCK_N: tl.constexpr):
    """Fold keys ``[n0, n0 + BLOCK_N)`` into the running softmax ``(acc, m_i, l_i)`` of a block of query rows.
    ``MASKED``: mask keys past ``len_k`` and, if ``CAUSAL``, those a row does not see; without it every key of the
    block must exist and be seen by every row."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < len_k
    offs_a = tl.arange(0, D_A)
    offs_v = tl.arange(0, D_V)
    k_rows = k_ptr + (k_start + offs_n)[:, None] * stride_k_t + head * stride_k_h
    v_rows = v_ptr + (k_start + offs_n)[:, None] * stride_v_t + head * stride_v_h
    if MASKED:
        k_a = tl.load(k_rows + offs_a[None, :], mask=mask_n[:, None], other=0.0)  # [BLOCK_N, D_A]
    else:
        k_a = tl.load(k_rows + offs_a[None, :])
    scores = tl.dot(q_a, tl.trans(k_a))  # [BLOCK_M, BLOCK_N]
    if D_B > 0:
        offs_b = tl.arange(0, D_B)
        if MASKED:
            k_b = tl.load(k_rows + D_A + offs_b[None, :], mask=mask_n[:, None], other=0.0)
        else:
            k_b = tl.load(k_rows + D_A + offs_b[None, :])
        scores = tl.dot(q_b, tl.trans(k_b), scores)
    scores = scores * qk_scale_log2
    if MASKED:
        seen = mask_n[None, :]
        if CAUSAL:
            seen = seen & (offs_n[None, :] <= offs_m[:, None] + shift)
        scores = tl.where(seen, scores, float("-inf"))
    p, alpha, m_i, l_i = online_softmax_step(scores, m_i, l_i)
    if MASKED:
        v = tl.load(v_rows + offs_v[None, :], mask=mask_n[:, None], other=0.0)  # [BLOCK_N, D_V]
    else:
        v = tl.load(v_rows + offs_v[None, :])
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, m_i, l_i


@triton.jit(do_not_specialize=["stride_lse_h"])  # the token count: one compiled kernel for any batch
def _varlen_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    lse_ptr,
    cu_q_ptr,
    cu_k_ptr,
    qk_scale_log2,
    stride_q_t,
    stride_q_h,
    stride_k_t,
    stride_k_h,
    stride_v_t,
    stride_v_h,
    stride_o_t,
    stride_o_h,
    stride_lse_h,
    stride_lse_t,
    D_A: tl.constexpr,
    D_B: tl.constexpr,
    D_V: tl.constexpr,
    CAUSAL: tl.constexpr,
    STORE_LSE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)  # the last query blocks, the longest under a causal mask, first
    seq = tl.program_id(1)
    head = tl.program_id(2).to(tl.int64)
    q_start = tl.load(cu_q_ptr + seq).to(tl.int64)
    len_q = tl.load(cu_q_ptr + seq + 1).to(tl.int64) - q_start
    k_start = tl.load(cu_k_ptr + seq).to(tl.int64)
    len_k = tl.load(cu_k_ptr + seq + 1).to(tl.int64) - k_start

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < len_q
    offs_a = tl.arange(0, D_A)
    offs_v = tl.arange(0, D_V)
    q_rows = q_ptr + (q_start + offs_m)[:, None] * stride_q_t + head * stride_q_h
    q_a = tl.load(q_rows + offs_a[None, :], mask=mask_m[:, None], other=0.0)  # [BLOCK_M, D_A]
    if D_B > 0:
        offs_b = tl.arange(0, D_B)
        q_b = tl.load(q_rows + D_A + offs_b[None, :], mask=mask_m[:, None], other=0.0)  # [BLOCK_M, D_B]
    else:
        q_b = q_a

    # Query i sees keys j <= i + shift (bottom-right causal alignment). Keys [0, full) are seen by every row of
    # the block and exist: they need no mask. Keys [full, hi) do.
    shift = len_k - len_q
    hi = len_k
    full = len_k
    if CAUSAL:
        hi = tl.minimum(len_k, (pid_m + 1) * BLOCK_M + shift)
        full = tl.minimum(len_k, pid_m * BLOCK_M + shift + 1)
    hi = tl.where(pid_m * BLOCK_M < len_q, hi, 0)
    full = tl.minimum(tl.maximum(full, 0) // BLOCK_N * BLOCK_N, hi)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_V], tl.float32)
    for n0 in range(0, full, BLOCK_N):
        acc, m_i, l_i = _attend_keys(acc, m_i, l_i, q_a, q_b, k_ptr, v_ptr, k_start, head, n0, offs_m, len_k, shift,
                                     qk_scale_log2, stride_k_t, stride_k_h, stride_v_t, stride_v_h, D_A, D_B, D_V,
                                     CAUSAL, False, BLOCK_N)
    for n0 in range(full, hi, BLOCK_N):
        acc, m_i, l_i = _attend_keys(acc, m_i, l_i, q_a, q_b, k_ptr, v_ptr, k_start, head, n0, offs_m, len_k, shift,
                                     qk_scale_log2, stride_k_t, stride_k_h, stride_v_t, stride_v_h, D_A, D_B, D_V,
                                     CAUSAL, True, BLOCK_N)

    inv_l, lse = finish_softmax(m_i, l_i)
    out = acc * inv_l[:, None]
    o_rows = out_ptr + (q_start + offs_m)[:, None] * stride_o_t + head * stride_o_h
    tl.store(o_rows + offs_v[None, :], out.to(out_ptr.dtype.element_ty), mask=mask_m[:, None])
    if STORE_LSE:
        tl.store(lse_ptr + head * stride_lse_h + (q_start + offs_m) * stride_lse_t, lse, mask=mask_m)


def split_head_dim(d_qk: int) -> tuple[int, int]:
    """``D_qk`` as ``D_A + D_B``: ``D_A`` the largest power of two in it, ``D_B`` a power of
    two or 0. Raises ``ValueError`` for a head size that is not of that form."""
    d_a = 1 << (d_qk.bit_length() - 1) if d_qk > 0 else 0
    d_b = d_qk - d_a
    if d_a < 16 or (d_b and (d_b < 16 or d_b & (d_b - 1))):
        raise ValueError(
            f"head size {d_qk} is not supported: it must be a power of two >= 16, or the sum of two (e.g. 192 = 128 + 64)"
        )
    return d_a, d_b


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    softmax_scale: float,
    causal: bool,
    return_lse: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention over packed variable-length sequences (module docstring: the formula).

    Args:
        q: ``[T_q, H, D_qk]`` bf16/fp16; ``D_qk`` a power of two or a sum of two (192).
        k: ``[T_k, H, D_qk]``, same dtype. Any strides with a contiguous last dim.
        v: ``[T_k, H, D_v]``, same dtype; ``D_v`` a power of two >= 16.
        cu_seqlens_q / cu_seqlens_k: ``[N + 1]`` int32 prefix sums of the per-sequence query
            and key counts (``cu[0] == 0``).
        max_seqlen_q: an upper bound of the query count of any sequence (sizes the grid).
        softmax_scale: multiplies ``q . k``.
        causal: bottom-right-aligned causal mask.
        return_lse: also return ``lse [H, T_q]`` fp32 (natural log; ``-inf`` where a query sees
            no key, whose output is then zero).
        out: optional ``[T_q, H, D_v]`` output buffer in the query dtype.

    Returns:
        ``out`` or ``(out, lse)``.

    Example::

        o = varlen_attention(q, k, v, cu, cu, max_len, 192**-0.5, causal=True)
    """
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError("q, k and v must be [T, H, D]")
    num_q, num_heads, d_qk = q.shape
    d_a, d_b = split_head_dim(d_qk)
    d_v = v.shape[-1]
    if d_v < 16 or d_v & (d_v - 1):
        raise ValueError(f"value head size {d_v} is not supported: a power of two >= 16 is")
    if k.shape[1:] != (num_heads, d_qk) or v.shape[:2] != k.shape[:2]:
        raise ValueError(f"shapes disagree: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.dtype not in HALF_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share a bf16 or fp16 dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape or cu_seqlens_q.dtype != torch.int32:
        raise ValueError("cu_seqlens_q and cu_seqlens_k must be int32 [N + 1] tensors of the same length")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("q, k and v need a contiguous last dimension")
    if out is None:
        out = q.new_empty(num_q, num_heads, d_v)
    lse = q.new_empty(num_heads, num_q, dtype=torch.float32) if return_lse else out
    num_seqs = cu_seqlens_q.shape[0] - 1
    if num_q and num_seqs and max_seqlen_q > 0:
        block_m, block_n, num_warps, num_stages = launch_config(q.device, d_qk, d_v, q.element_size())
        grid = (triton.cdiv(max_seqlen_q, block_m), num_seqs, num_heads)
        _varlen_attention_kernel[grid](
            q,
            k,
            v,
            out,
            lse,
            cu_seqlens_q,
            cu_seqlens_k,
            softmax_scale * _LOG2E,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            out.stride(0),
            out.stride(1),
            lse.stride(0) if return_lse else 0,
            lse.stride(1) if return_lse else 0,
            D_A=d_a,
            D_B=d_b,
            D_V=d_v,
            CAUSAL=causal,
            STORE_LSE=return_lse,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            num_warps=num_warps,
            num_stages=num_stages,
        )
    return (out, lse) if return_lse else out


@functools.cache
def warm_up_varlen_attention(device: torch.device, dtype: torch.dtype, d_qk: int, d_v: int) -> None:
    """Compile ``varlen_attention`` for each launch the engines make: new tokens without the log-sum-exp, new tokens
    with it (after a cached prefix) and a chunk of cached context. vLLM's own warm-up runs only the first, so
    the others compiled on the first long or prefix-cached prompt, while serving (vLLM's JIT monitor named the
    kernel: ``benchmarks/results/mla_prefill-final-h100-2026-12-06-s43.md``). Runs once per process and arguments,
    on a few zeros; nothing on a CPU or in Triton's interpreter. The kernel's compiled variants do not depend on
    the token, sequence or head counts; inputs whose rows are not 16-byte aligned would still compile their own."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return
    q = torch.zeros(16, 1, d_qk, dtype=dtype, device=device)
    kv = torch.zeros(16, 1, d_qk + d_v, dtype=dtype, device=device)
    cu = torch.tensor([0, 16], dtype=torch.int32, device=device)
    for causal, return_lse in LAUNCH_VARIANTS:
        varlen_attention(q, kv[..., :d_qk], kv[..., d_qk:], cu, cu, 16, 1.0, causal=causal, return_lse=return_lse)
    torch.cuda.synchronize(device)
