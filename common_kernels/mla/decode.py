"""MLA decode: weight-absorbed multi-query attention over the paged latent cache.

For query row ``(t, h)`` of request ``b`` (token ``j`` of its ``S_q`` query tokens)::

    s_n   = scale * (q_nope[t, h] . c_n + q_pe[t, h] . r_n),   n < seq_lens[b] - S_q + j + 1
    out   = sum_n softmax(s)_n * c_n                            [D_latent]
    lse   = log sum_n exp(s_n)

where ``[c_n | r_n]`` is cache row ``n`` of the request (``D_latent`` latent values, then
``D_rope`` rotated key values; fp8 rows are multiplied by the per-tensor ``kv_scale``). For
tree verification a per-token ancestor mask replaces the causal bound on the last ``S_q``
positions (the draft tokens); the prefix stays fully visible.

Work split (split-KV, "flash decoding"): program ``(g, s, b)`` takes up to ``BLOCK_R`` query
rows of request ``b`` -- all heads and all query tokens when they fit, so a cache tile is read
once for every head of the request -- and the ``s``-th of ``S`` equal stretches of its
cache. It streams tiles of ``BLOCK_N`` tokens (one page holds a whole tile), keeping one
``[BLOCK_N, D_latent]`` load for both ``Q K^T`` and ``P V``. With ``S > 1`` each program
writes a normalized partial output and its log-sum-exp, and a second kernel merges them;
with ``S == 1`` the first kernel writes the result directly. Row groups are the fastest
grid axis, so when ``H * S_q > BLOCK_R`` the programs sharing a tile run side by side and
the re-read is served from L2.

fp8 caches: tiles are widened to fp16 (one native conversion per two values; fp8 to bf16
costs three more), and the queries are brought to fp16 range by a power of two per row,
which is exact. Row groups of 64 (``H * S_q >= 33``) instead compute ``Q K^T`` on fp8 tensor
cores: each query row ``[q_nope | q_pe]`` is scaled by the power of two that brings its
largest magnitude into ``[128, 256)`` and rounded to E4M3 (``DecodePlan.fp8_queries``; the
reference models it with ``fp8_queries=True``), and ``P V`` stays in fp16.

On sm_90, plans made for it (``plan_decode(..., sm90=True)``, see ``sm90_kernels_apply``) run
launches over a paged cache on Gluon kernels instead (same contract and partials, faster
layouts): ``decode_sm90_seesaw`` for 64-row groups, ``decode_sm90_narrow`` for 16- and 32-row
groups; over fp8 caches both round the queries to E4M3. Everything else runs the Triton kernel
below.

Extends over an fp8 cache can pass the new tokens' own latent rows (``fresh_kv``): the cached
prefix is then one launch (every query sees all of it) and the new tokens' causal block a
second one over those dense rows at full precision, merged as one more split. Only the
prefix is read rounded, as in the engines' own MHA prefill paths.
"""

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..fp8_format import FP8_DTYPES
from . import decode_sm90_narrow, decode_sm90_seesaw
from .cache import HALF_DTYPES
from .softmax import finish_softmax, online_softmax_step

_LOG2E = 1.4426950408889634
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _launch_config(block_rows: int, page_size: int, is_fp8: bool) -> tuple[int, int, int]:
    """``(BLOCK_N, num_warps, num_stages)`` for a decode launch: fixed per shape, so a CUDA
    graph can be captured without benchmarking inside the capture (Triton's autotuner
    times candidates with device syncs, which capture forbids) and every batch of a shape
    runs the same code. Chosen on the H200 (benchmarks/results/mla_decode_sweeps-2026-11-30.md):
    32-token tiles and 4 warps for 16-row bf16 groups; otherwise 64-token tiles, with 8 warps
    for 64-row groups (a 64 x 512 fp32 accumulator) and for fp8 tiles, whose conversion needs
    registers, and 4 warps else. Tiles never cross a page."""
    if _INTERPRET:
        return 16, 4, 1
    if not is_fp8 and block_rows <= 16:
        return min(page_size, 32), 4, 2
    return min(page_size, 64), 8 if block_rows >= 64 or is_fp8 else 4, 2


@triton.jit
def _mla_decode_split_kernel(
    q_nope_ptr,
    q_pe_ptr,
    cache_ptr,
    block_table_ptr,
    seq_lens_ptr,
    kv_scale_ptr,
    tree_mask_ptr,
    q_start_ptr,
    out_ptr,
    lse_ptr,
    qk_scale_log2,
    uniform_q_len,
    stride_qn_t,
    stride_qn_h,
    stride_qp_t,
    stride_qp_h,
    stride_cache_block,
    stride_cache_tok,
    stride_bt_b,
    stride_out_t,
    stride_out_h,
    stride_out_s,
    stride_lse_t,
    stride_lse_h,
    NUM_HEADS: tl.constexpr,
    D_LATENT: tl.constexpr,
    D_ROPE: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_FP8: tl.constexpr,
    FP8_QUERIES: tl.constexpr,
    DIRECT_OUT: tl.constexpr,
    TREE_MASK: tl.constexpr,
    VARLEN: tl.constexpr,
    PREFIX_ONLY: tl.constexpr,
    KEYS_DENSE: tl.constexpr,
):
    pid_g = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_b = tl.program_id(2).to(tl.int64)
    num_splits = tl.num_programs(1)

    if VARLEN:
        q_start = tl.load(q_start_ptr + pid_b).to(tl.int64)
        q_len = tl.load(q_start_ptr + pid_b + 1).to(tl.int64) - q_start
    else:
        q_start = pid_b * uniform_q_len
        q_len = uniform_q_len
    # Query row r of the request is token r // H, head r % H.
    offs_r = pid_g * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = offs_r < q_len * NUM_HEADS
    tok_j = offs_r // NUM_HEADS
    head = offs_r % NUM_HEADS
    tok = q_start + tok_j

    # The request's query tokens are its last q_len cache positions, from draft_start on.
    # Causal: token j sees positions < draft_start + j + 1. Tree: the whole prefix, and draft
    # token k when bit k of the request's mask word for token j is set. PREFIX_ONLY: the keys
    # stop at draft_start, all visible to every query. KEYS_DENSE: the keys are the query
    # tokens' own rows, dense from row q_start of cache_ptr, causal.
    if KEYS_DENSE:
        draft_start = 0
        num_keys = q_len
    else:
        seq_len = tl.load(seq_lens_ptr + pid_b)
        draft_start = seq_len - q_len
        num_keys = seq_len
        if PREFIX_ONLY:
            num_keys = draft_start
    if TREE_MASK:
        mask_bits = tl.load(tree_mask_ptr + tok, mask=mask_r, other=0)  # [BLOCK_R] int64
    else:
        visible = draft_start + 1 + tok_j  # [BLOCK_R]
    split_len = tl.cdiv(tl.cdiv(num_keys, num_splits), BLOCK_N) * BLOCK_N
    start = pid_s * split_len
    end = tl.minimum(start + split_len, num_keys)

    offs_c = tl.arange(0, D_LATENT)
    offs_p = tl.arange(0, D_ROPE)
    q_nope = tl.load(
        q_nope_ptr + tok[:, None] * stride_qn_t + head[:, None] * stride_qn_h + offs_c[None, :],
        mask=mask_r[:, None],
        other=0.0,
    )  # [BLOCK_R, D_LATENT]
    q_pe = tl.load(
        q_pe_ptr + tok[:, None] * stride_qp_t + head[:, None] * stride_qp_h + offs_p[None, :],
        mask=mask_r[:, None],
        other=0.0,
    )  # [BLOCK_R, D_ROPE]

    if IS_FP8:
        kv_scale = tl.load(kv_scale_ptr)
        q_max = tl.maximum(tl.max(tl.abs(q_nope.to(tl.float32)), 1), tl.max(tl.abs(q_pe.to(tl.float32)), 1))
        # A power of two per row, so scaling is exact: max|row| * q_scale in [2^(E-1), 2^E).
        q_exp = ((tl.maximum(q_max, 1e-30).to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        if FP8_QUERIES:
            q_scale = ((127 + 7 - q_exp) << 23).to(tl.float32, bitcast=True)  # E = 8
            q_nope = (q_nope.to(tl.float32) * q_scale[:, None]).to(tl.float8e4nv)
            q_pe = (q_pe.to(tl.float32) * q_scale[:, None]).to(tl.float8e4nv)
        else:
            q_scale = ((127 + 14 - q_exp) << 23).to(tl.float32, bitcast=True)  # E = 15, fp16 max 65504
            q_nope = (q_nope.to(tl.float32) * q_scale[:, None]).to(tl.float16)
            q_pe = (q_pe.to(tl.float32) * q_scale[:, None]).to(tl.float16)
        score_scale = qk_scale_log2 * kv_scale / q_scale  # [BLOCK_R]
    else:
        kv_scale = 1.0
        score_scale = tl.full([BLOCK_R], qk_scale_log2, tl.float32)
    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, D_LATENT], tl.float32)

    bt_row = block_table_ptr + pid_b * stride_bt_b
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        if KEYS_DENSE:
            rows = cache_ptr + (q_start + offs_n)[:, None] * stride_cache_tok
        else:
            page = tl.load(bt_row + n0 // PAGE_SIZE).to(tl.int64)
            rows = cache_ptr + page * stride_cache_block + (offs_n % PAGE_SIZE)[:, None] * stride_cache_tok
        kv_c = tl.load(rows + offs_c[None, :], mask=mask_n[:, None], other=0.0)  # [BLOCK_N, D_LATENT]
        k_pe = tl.load(rows + D_LATENT + offs_p[None, :], mask=mask_n[:, None], other=0.0)  # [BLOCK_N, D_ROPE]
        if IS_FP8:
            # fp8 values are exact in fp16; the scale is applied to scores and output.
            v = kv_c.to(tl.float16)
            if not FP8_QUERIES:
                kv_c = v
                k_pe = k_pe.to(tl.float16)
        else:
            v = kv_c
        scores = tl.dot(q_nope, tl.trans(kv_c))
        scores = tl.dot(q_pe, tl.trans(k_pe), scores)  # [BLOCK_R, BLOCK_N]
        if TREE_MASK:
            draft_k = offs_n - draft_start  # [BLOCK_N]
            in_tree = ((mask_bits[:, None] >> tl.maximum(draft_k, 0)[None, :].to(tl.int64)) & 1) != 0
            seen = mask_n[None, :] & ((draft_k < 0)[None, :] | in_tree)
        elif PREFIX_ONLY:
            seen = mask_n[None, :]
        else:
            seen = mask_n[None, :] & (offs_n[None, :] < visible[:, None])
        scores = tl.where(seen, scores * score_scale[:, None], float("-inf"))
        p, alpha, m_i, l_i = online_softmax_step(scores, m_i, l_i)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])

    inv_l, lse = finish_softmax(m_i, l_i)
    out = acc * (kv_scale * inv_l)[:, None]
    out_rows = out_ptr + tok[:, None] * stride_out_t + head[:, None] * stride_out_h + offs_c[None, :]
    if DIRECT_OUT:
        tl.store(out_rows, out.to(out_ptr.dtype.element_ty), mask=mask_r[:, None])
        tl.store(lse_ptr + tok * stride_lse_t + head * stride_lse_h, lse, mask=mask_r)
    else:
        tl.store(out_rows + pid_s * stride_out_s, out, mask=mask_r[:, None])
        tl.store(lse_ptr + tok * stride_lse_t + head * stride_lse_h + pid_s, lse, mask=mask_r)


@triton.jit
def _mla_decode_combine_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    lse_ptr,
    num_splits,
    stride_po_t,
    stride_po_h,
    stride_po_s,
    stride_pl_t,
    stride_pl_h,
    stride_out_t,
    stride_out_h,
    stride_lse_t,
    stride_lse_h,
    D_LATENT: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_c = tl.arange(0, D_LATENT)
    m = float("-inf")
    denom = 0.0
    acc = tl.zeros([D_LATENT], tl.float32)
    for s in range(num_splits):
        lse_s = tl.load(part_lse_ptr + tok * stride_pl_t + head * stride_pl_h + s)
        if lse_s > float("-inf"):
            out_s = tl.load(part_out_ptr + tok * stride_po_t + head * stride_po_h + s * stride_po_s + offs_c)
            m_new = tl.maximum(m, lse_s)
            alpha = tl.exp(m - m_new)
            w = tl.exp(lse_s - m_new)
            acc = acc * alpha + w * out_s
            denom = denom * alpha + w
            m = m_new
    has_keys = denom > 0.0
    out = acc / tl.where(has_keys, denom, 1.0)
    tl.store(out_ptr + tok * stride_out_t + head * stride_out_h + offs_c, out.to(out_ptr.dtype.element_ty))
    lse = tl.where(has_keys, m + tl.log(tl.where(has_keys, denom, 1.0)), float("-inf"))
    tl.store(lse_ptr + tok * stride_lse_t + head * stride_lse_h, lse)


@dataclass(frozen=True)
class DecodePlan:
    """Per-batch launch decisions, computed once and shared by every layer.

    ``num_splits`` depends only on the batch shape and the longest context, so a plan made
    for CUDA-graph capture stays valid for any shorter context replayed in that graph.
    """

    batch: int
    q_len: int
    num_heads: int
    block_rows: int
    num_splits: int
    sm90: bool = False  # made for the Gluon kernels of sm_90 (``sm90_kernels_apply``)
    paired: bool = False  # sm_90's narrow fp8 launches as paired programs (``decode_sm90_narrow.pairs``)
    long_splits: bool = True  # sm_90's 64-row fp8 launches may run P V in fp8 (``decode_sm90_seesaw.fp8_pv_pays``)

    def fp8_queries(self, cache_dtype: torch.dtype) -> bool:
        """Whether ``Q K^T`` runs in fp8 (queries quantized per row to E4M3): fp8 caches
        with row groups of 64, or any row group on sm_90's kernels."""
        return cache_dtype in FP8_DTYPES and (self.block_rows >= MAX_BLOCK_ROWS or self.sm90)

    def fp8_probs(self, cache_dtype: torch.dtype) -> bool:
        """Whether ``P V`` runs in fp8 (``P`` rounded to the cache's format) over a paged cache: fp8
        caches on sm_90's kernels, in row groups of 16 and 32 (``decode_sm90_narrow.fp8_pv``) and of 64
        (``decode_sm90_seesaw.fp8_pv``, on plans with ``long_splits``)."""
        if not self.sm90:
            return False
        if self.block_rows in decode_sm90_narrow.BLOCK_ROWS:
            return decode_sm90_narrow.fp8_pv(cache_dtype)
        return (self.block_rows == decode_sm90_seesaw.BLOCK_R and self.long_splits
                and decode_sm90_seesaw.fp8_pv(cache_dtype))

    @property
    def row_groups(self) -> int:
        return triton.cdiv(self.num_heads * self.q_len, self.block_rows)

    def workspace_shapes(self, d_latent: int, fresh_kv: bool = False) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Shapes of the fp32 partial output and partial log-sum-exp buffers (one more partial
        with ``fresh_kv``)."""
        tokens, parts = self.batch * self.q_len, self.num_splits + fresh_kv
        return (tokens, self.num_heads, parts, d_latent), (tokens, self.num_heads, parts)


MAX_BLOCK_ROWS = 64
# Splits shorter than this cost more in the merge than they gain (H200, batch 1: 64 tokens beat
# 128 and 256 up to 2k tokens).
MIN_TOKENS_PER_SPLIT = 64
# Beyond this many splits the fp32 partials (H x D_latent per split and query token) cost more
# to write and merge than the extra parallelism gains (H200, batch 1, 4k tokens: 32 beat 64).
MAX_SPLITS = 32
MAX_PROGRAMS_PER_SM = 3
# Programs sharing a multiprocessor only pay off over long splits: a second program of the narrow
# fp8 kernel is taken only while every split still reads this many tokens (H200, fp8, batch 1-128:
# benchmarks/results/mla_decode-sm90-narrow-fp8-2026-12-01.md).
MIN_TOKENS_PER_SHARED_SPLIT = 256


def programs_per_sm(block_rows: int, cache_dtype: torch.dtype | None, sm90: bool = False) -> int:
    """Split-kernel programs one multiprocessor holds at once with ``_launch_config``'s choices:
    three 4-warp bf16 launches of 16-row groups (159 registers a thread, ptxas for sm_90a; three
    beat two at batch 128); one 8-warp launch (all 255 registers a thread). sm_90's Gluon
    kernels take most of the shared memory: one, except two of the narrow kernel's unpaired fp8
    launches."""
    fp8 = cache_dtype in FP8_DTYPES
    if sm90:
        return decode_sm90_narrow.programs_per_sm(block_rows, fp8, False)  # 64-row groups (seesaw): one
    return MAX_PROGRAMS_PER_SM if block_rows <= 16 and not fp8 else 1


def plan_decode(
    batch: int,
    num_heads: int,
    q_len: int,
    max_seq_len: int,
    num_sms: int,
    num_splits: int | None = None,
    cache_dtype: torch.dtype | None = None,
    sm90: bool = False,
) -> DecodePlan:
    """Choose the row-group size and the split count for one decode batch.

    The split count fills one wave of the GPU (``programs_per_sm`` programs per multiprocessor)
    without giving a split fewer than ``MIN_TOKENS_PER_SPLIT`` tokens or making more than
    ``MAX_SPLITS`` (benchmarks/results/mla_decode-splits-2026-12-01.md). On sm_90's narrow fp8
    kernel: paired programs (one a multiprocessor) where their splits are long enough
    (``decode_sm90_narrow.pairs``), else two one-warpgroup programs, or one where two would leave
    splits shorter than ``MIN_TOKENS_PER_SHARED_SPLIT``. On its 64-row kernel: ``P V`` in fp8 only where
    the splits are long or the launch has programs for more than half the multiprocessors
    (``decode_sm90_seesaw.fp8_pv_pays``). ``cache_dtype``
    (default bf16) sets the launch, hence the occupancy. ``num_splits`` overrides the heuristic
    (1 gives a deterministic, batch-invariant merge). ``sm90``: the launches will run on sm_90's
    Gluon kernels (pass ``sm90_kernels_apply(...)``); without it they run the Triton kernel.
    """
    if batch < 0 or num_heads < 1 or q_len < 1:
        raise ValueError(f"bad decode batch: batch={batch}, num_heads={num_heads}, q_len={q_len}")
    rows = num_heads * q_len
    block_rows = min(MAX_BLOCK_ROWS, max(16, triton.next_power_of_2(rows)))
    fp8 = cache_dtype in FP8_DTYPES

    groups = max(1, batch) * triton.cdiv(rows, block_rows)

    def paired(splits: int) -> bool:
        return sm90 and decode_sm90_narrow.pairs(block_rows, fp8, max_seq_len // splits)

    def long_splits(splits: int) -> bool:
        return decode_sm90_seesaw.fp8_pv_pays(max_seq_len // splits, groups * splits, num_sms)

    if num_splits is not None:
        return DecodePlan(batch, q_len, num_heads, block_rows, num_splits, sm90, paired(num_splits),
                          long_splits(num_splits))
    by_length = triton.cdiv(max(1, max_seq_len), MIN_TOKENS_PER_SPLIT)

    def filling(programs: int) -> int:
        return max(1, min(programs * num_sms // groups, by_length, MAX_SPLITS))

    num_splits = filling(1)
    if paired(num_splits):
        return DecodePlan(batch, q_len, num_heads, block_rows, num_splits, sm90, True)
    programs = programs_per_sm(block_rows, cache_dtype, sm90)
    num_splits = filling(programs)
    if sm90 and programs > 1 and max_seq_len < num_splits * MIN_TOKENS_PER_SHARED_SPLIT:
        num_splits = filling(1)
    return DecodePlan(batch, q_len, num_heads, block_rows, num_splits, sm90, long_splits=long_splits(num_splits))


def max_workspace_tokens_times_splits(max_batch: int, num_sms: int) -> int:
    """An upper bound of ``batch * num_splits`` over every plan ``plan_decode`` can make for
    batches up to ``max_batch``: reserve decode workspaces with it once, up front."""
    return max(max_batch, MAX_PROGRAMS_PER_SM * num_sms)


MAX_TREE_TOKENS = 64  # one int64 mask word per query token


def _validate(q_nope, q_pe, kv_cache, block_table, seq_lens, kv_scale, plan, tree_mask, query_start_loc):
    if q_nope.dim() != 3 or q_pe.dim() != 3 or q_nope.shape[:2] != q_pe.shape[:2]:
        raise ValueError(f"q_nope {tuple(q_nope.shape)} and q_pe {tuple(q_pe.shape)} must be [T, H, D]")
    num_tokens, num_heads, d_latent = q_nope.shape
    d_rope = q_pe.shape[-1]
    for name, dim in (("D_latent", d_latent), ("D_rope", d_rope)):
        if dim < 16 or dim & (dim - 1) or dim > 1024:
            raise ValueError(f"{name}={dim} is not supported: a power of two from 16 to 1024 is")
    if q_nope.dtype not in HALF_DTYPES or q_pe.dtype != q_nope.dtype:
        raise ValueError(f"queries must be bf16 or fp16 and match, got {q_nope.dtype}/{q_pe.dtype}")
    if kv_cache.dim() != 3 or kv_cache.shape[-1] != d_latent + d_rope:
        raise ValueError(f"kv_cache must be [N_blocks, B_page, {d_latent + d_rope}], got {tuple(kv_cache.shape)}")
    page = kv_cache.shape[1]
    if page < 16 or page & (page - 1):
        raise ValueError(f"block size {page} is not supported: a power of two >= 16 is")
    if kv_cache.dtype not in FP8_DTYPES and kv_cache.dtype != q_nope.dtype:
        raise ValueError(f"kv_cache dtype {kv_cache.dtype} must be fp8 E4M3/E5M2 or the query dtype {q_nope.dtype}")
    if kv_cache.dtype in FP8_DTYPES and kv_scale is None:
        raise ValueError("an fp8 kv_cache needs kv_scale")
    batch = seq_lens.shape[0]
    if plan.batch != batch or plan.num_heads != num_heads:
        raise ValueError(f"plan {plan} does not match H={num_heads}, batch={batch}")
    if query_start_loc is None and batch * plan.q_len != num_tokens:
        raise ValueError(f"T={num_tokens} must be batch * q_len = {batch} * {plan.q_len} without query_start_loc")
    if query_start_loc is not None:
        if query_start_loc.shape != (batch + 1,) or query_start_loc.dtype != torch.int32:
            raise ValueError(f"query_start_loc must be int32 [B + 1] = [{batch + 1}], got {query_start_loc.dtype} "
                             f"{tuple(query_start_loc.shape)}")
        if tree_mask is not None:
            raise ValueError("tree_mask needs uniform query lengths (no query_start_loc)")
    if block_table.dim() != 2 or block_table.shape[0] < batch:
        raise ValueError(f"block_table must be [B, max_blocks] with B >= {batch}, got {tuple(block_table.shape)}")
    if block_table.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise ValueError(f"block_table and seq_lens must be int32, got {block_table.dtype}/{seq_lens.dtype}")
    if q_nope.stride(-1) != 1 or q_pe.stride(-1) != 1 or kv_cache.stride(-1) != 1 or block_table.stride(-1) != 1:
        raise ValueError("q_nope, q_pe, kv_cache and block_table need a contiguous last dimension")
    if tree_mask is not None:
        if plan.q_len > MAX_TREE_TOKENS:
            raise ValueError(f"a tree of {plan.q_len} draft tokens is not supported: at most {MAX_TREE_TOKENS} are")
        if tree_mask.shape != (batch, plan.q_len) or tree_mask.dtype != torch.int64 or not tree_mask.is_contiguous():
            raise ValueError(
                f"tree_mask must be a contiguous int64 [B, S_q] = [{batch}, {plan.q_len}] tensor, "
                f"got {tree_mask.dtype} {tuple(tree_mask.shape)}"
            )


def _validate_fresh(fresh_kv, q_nope, d_total, tree_mask):
    if fresh_kv.shape != (q_nope.shape[0], d_total) or fresh_kv.dtype != q_nope.dtype or fresh_kv.stride(-1) != 1:
        raise ValueError(f"fresh_kv must be [T, D_latent + D_rope] = [{q_nope.shape[0]}, {d_total}] {q_nope.dtype} "
                         f"with a contiguous last dimension, got {fresh_kv.dtype} {tuple(fresh_kv.shape)}")
    if tree_mask is not None:
        raise ValueError("fresh_kv is not supported with tree_mask")


def mla_decode(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
    plan: DecodePlan,
    kv_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
    tree_mask: torch.Tensor | None = None,
    query_start_loc: torch.Tensor | None = None,
    fresh_kv: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight-absorbed MLA decode over a paged latent cache (module docstring: the formula).

    Args:
        q_nope: ``[T, H, D_latent]`` bf16/fp16, queries already multiplied by ``W_UK``;
            ``T = B * S_q`` with the ``S_q`` tokens of a request adjacent. Any strides with
            a contiguous last dim (vLLM passes a transposed view).
        q_pe: ``[T, H, D_rope]``, same dtype, the rotated query part.
        kv_cache: ``[N_blocks, B_page, D_latent + D_rope]`` bf16/fp16 (the query dtype) or
            ``torch.float8_e4m3fn`` / ``torch.float8_e5m2``; ``B_page`` a power of two >= 16.
        block_table: ``[B, max_blocks]`` int32 page ids; only the first
            ``cdiv(seq_lens[b], B_page)`` entries of a row are read.
        seq_lens: ``[B]`` int32 cache tokens per request, the query tokens included; 0 gives a
            zero output and ``lse = -inf`` (CUDA-graph padding).
        softmax_scale: multiplies ``q . k`` before the softmax.
        plan: from ``plan_decode(B, H, S_q, max(seq_lens), num_sms, cache_dtype=..., sm90=...)``.
        kv_scale: ``[1]`` fp32 per-tensor dequantization scale (fp8 caches only).
        out: optional ``[T, H, D_latent]`` output in the query dtype (CUDA-graph-safe buffer).
        lse: optional ``[T, H]`` fp32 log-sum-exp (natural log) buffer.
        workspace: optional fp32 ``(partial_out, partial_lse)`` of ``plan.workspace_shapes``,
            used when ``plan.num_splits > 1``.
        tree_mask: optional ``[B, S_q]`` int64 for tree verification (``S_q <= 64`` draft
            tokens, the last ``S_q`` cache positions of each request): bit ``k`` of
            ``tree_mask[b, j]`` set lets draft token ``j`` see draft token ``k``; every token
            sees the whole prefix. Replaces the causal mask (which is the chain
            ``tree_mask[b, j] = 2**(j + 1) - 1``).
        query_start_loc: optional ``[B + 1]`` int32 prefix sums of per-request query counts,
            for ragged query lengths (chunked prefill over a cached prefix in absorbed form);
            ``plan.q_len`` is then the largest count. Causal within each request.
        fresh_kv: optional ``[T, D_latent + D_rope]`` rows ``[c | r]`` of the query tokens
            themselves, in the query dtype: their positions (the last ``S_q`` of each request)
            are read from here instead of the cache. For extends over an fp8 cache, whose
            copy of the new tokens is rounded; costs one more launch and partial. Not with
            ``tree_mask``.

    Returns:
        ``(out, lse)``: ``out [T, H, D_latent]`` in the query dtype, ``lse [T, H]`` fp32.

    Example::

        sm90 = sm90_kernels_apply(cache.device, cache.dtype, cache.shape[1], 512, 64)
        plan = plan_decode(batch=B, num_heads=128, q_len=1, max_seq_len=4096, num_sms=132,
                           cache_dtype=cache.dtype, sm90=sm90)
        out, lse = mla_decode(q_nope, q_pe, cache, block_table, seq_lens, 192**-0.5, plan)
    """
    _validate(q_nope, q_pe, kv_cache, block_table, seq_lens, kv_scale, plan, tree_mask, query_start_loc)
    if fresh_kv is not None:
        _validate_fresh(fresh_kv, q_nope, kv_cache.shape[-1], tree_mask)
    num_tokens, num_heads, d_latent = q_nope.shape
    if out is None:
        out = q_nope.new_empty(num_tokens, num_heads, d_latent)
    elif (out.shape != q_nope.shape or out.dtype != q_nope.dtype or out.stride(-1) != 1 or out.stride(0) % 4
          or out.stride(1) % 4):  # the sm_90 kernels store four columns at once
        raise ValueError(f"out must be {q_nope.dtype} [T, H, D_latent] = {list(q_nope.shape)} with a contiguous last "
                         f"dimension and token and head strides that are multiples of 4, got {out.dtype} "
                         f"{list(out.shape)} with strides {out.stride()}")
    if lse is None:
        lse = q_nope.new_empty(num_tokens, num_heads, dtype=torch.float32)
    if num_tokens == 0:
        return out, lse
    num_parts = plan.num_splits + (fresh_kv is not None)
    direct = num_parts == 1
    if direct:
        part_out, part_lse = out, lse
        part_out_strides = (out.stride(0), out.stride(1), 0)
    else:
        if workspace is None:
            po_shape, pl_shape = plan.workspace_shapes(d_latent, fresh_kv is not None)
            workspace = (
                q_nope.new_empty(po_shape, dtype=torch.float32),
                q_nope.new_empty(pl_shape, dtype=torch.float32),
            )
        part_out, part_lse = workspace
        expected = plan.workspace_shapes(d_latent, fresh_kv is not None)
        if (tuple(part_out.shape), tuple(part_lse.shape)) != expected or part_out.dtype != torch.float32:
            raise ValueError(f"workspace must be fp32 of shapes {expected} (plan.workspace_shapes), got "
                             f"{part_out.dtype} {tuple(part_out.shape)} and {tuple(part_lse.shape)}")
        part_out_strides = part_out.stride()[:3]
    launch = dict(q_nope=q_nope, q_pe=q_pe, block_table=block_table, seq_lens=seq_lens, tree_mask=tree_mask,
                  query_start_loc=query_start_loc, part_out_strides=part_out_strides, direct=direct,
                  softmax_scale=softmax_scale, plan=plan)
    _launch_split(keys=kv_cache, kv_scale=kv_scale, part_out=part_out, part_lse=part_lse, num_splits=plan.num_splits,
                  prefix_only=fresh_kv is not None, **launch)
    if fresh_kv is not None:  # the query tokens' own rows, as one more partial
        last = plan.num_splits
        _launch_split(keys=fresh_kv, kv_scale=None, part_out=part_out[:, :, last:], part_lse=part_lse[:, :, last:],
                      num_splits=1, prefix_only=False, **launch)
    if not direct:
        _mla_decode_combine_kernel[(num_tokens, num_heads)](
            part_out,
            part_lse,
            out,
            lse,
            num_parts,
            *part_out.stride()[:3],
            part_lse.stride(0),
            part_lse.stride(1),
            out.stride(0),
            out.stride(1),
            lse.stride(0),
            lse.stride(1),
            D_LATENT=d_latent,
        )
    return out, lse


@functools.cache
def _is_sm90(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) == (9, 0)


def sm90_kernel_enabled(device: torch.device) -> bool:
    """Whether ``device`` runs the Gluon kernels for sm_90: an sm_90 GPU, outside the interpreter,
    unless ``LATENTSPEED_MLA_DECODE_SM90=0`` keeps the Triton kernel."""
    return (not _INTERPRET and device.type == "cuda" and os.environ.get("LATENTSPEED_MLA_DECODE_SM90", "1") != "0"
            and _is_sm90(device))


def sm90_kernel_for(block_rows: int, keys_dtype: torch.dtype, paged: bool, page_size: int, d_latent: int,
                    d_rope: int):
    """The module of the Gluon kernel for sm_90 that takes a launch of this shape, or None."""
    for module in (decode_sm90_seesaw, decode_sm90_narrow):
        if module.fits(block_rows, keys_dtype, paged, page_size, d_latent, d_rope):
            return module
    return None


def sm90_kernels_apply(device: torch.device, cache_dtype: torch.dtype, page_size: int, d_latent: int,
                       d_rope: int) -> bool:
    """Whether decode over a paged cache of this kind runs on the Gluon kernels for sm_90 on
    ``device``: pass it to ``plan_decode(..., sm90=...)``."""
    return (sm90_kernel_enabled(device)
            and sm90_kernel_for(MAX_BLOCK_ROWS, cache_dtype, True, page_size, d_latent, d_rope) is not None)


def _launch_split(q_nope, q_pe, keys, block_table, seq_lens, kv_scale, tree_mask, query_start_loc, part_out, part_lse,
                  part_out_strides, direct, num_splits, softmax_scale, plan, prefix_only):
    """One launch of the split kernel over ``keys``: the paged cache ``[N_blocks, B_page, D]``,
    or (2-D) the query tokens' own rows ``[T, D]``."""
    dense = keys.dim() == 2
    is_fp8 = keys.dtype in FP8_DTYPES
    page_size = MAX_BLOCK_ROWS if dense else keys.shape[1]
    d_rope = q_pe.shape[-1]
    module = (sm90_kernel_for(plan.block_rows, keys.dtype, not dense, page_size, keys.shape[-1] - d_rope, d_rope)
              if plan.sm90 and sm90_kernel_enabled(keys.device) else None)
    if module is decode_sm90_seesaw:
        kernel, block_n = decode_sm90_seesaw.mla_decode_split_kernel_sm90_seesaw, decode_sm90_seesaw.BLOCK_N
        options = decode_sm90_seesaw.launch_options(plan.fp8_probs(keys.dtype))
    elif module is decode_sm90_narrow:
        kernel, block_n = decode_sm90_narrow.mla_decode_split_kernel_sm90_narrow, decode_sm90_narrow.BLOCK_N
        options = decode_sm90_narrow.launch_options(keys, plan.fp8_probs(keys.dtype), plan.paired)
    else:
        kernel = _mla_decode_split_kernel
        block_n, num_warps, num_stages = _launch_config(plan.block_rows, page_size, is_fp8)
        options = dict(num_warps=num_warps, num_stages=num_stages)
    kernel[(plan.row_groups, num_splits, plan.batch)](
        q_nope,
        q_pe,
        keys,
        block_table,
        seq_lens,
        kv_scale if is_fp8 else seq_lens,  # never read when not fp8
        tree_mask if tree_mask is not None else seq_lens,  # never read without a tree
        query_start_loc if query_start_loc is not None else seq_lens,  # never read when uniform
        part_out,
        part_lse,
        softmax_scale * _LOG2E,
        plan.q_len,
        q_nope.stride(0),
        q_nope.stride(1),
        q_pe.stride(0),
        q_pe.stride(1),
        0 if dense else keys.stride(0),
        keys.stride(-2),
        block_table.stride(0),
        *part_out_strides,
        part_lse.stride(0),
        part_lse.stride(1),
        NUM_HEADS=q_nope.shape[1],
        D_LATENT=q_nope.shape[-1],
        D_ROPE=q_pe.shape[-1],
        PAGE_SIZE=page_size,
        BLOCK_R=plan.block_rows,
        IS_FP8=is_fp8,
        FP8_QUERIES=plan.fp8_queries(keys.dtype),
        DIRECT_OUT=direct,
        TREE_MASK=tree_mask is not None,
        VARLEN=query_start_loc is not None,
        PREFIX_ONLY=prefix_only,
        KEYS_DENSE=dense,
        BLOCK_N=block_n,
        **options,
    )
