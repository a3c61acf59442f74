"""The MLA decode split kernel for Hopper (sm_90), in Gluon: 64-row groups over an fp8 cache.

Same contract, arguments and partial outputs as ``decode._mla_decode_split_kernel`` (the module
docstring of ``decode`` has the formula), for the launches it takes: ``BLOCK_R = 64`` rows,
``D_latent = 512``, ``D_rope = 64``, a paged fp8 cache with E4M3 queries as
``DecodePlan.fp8_queries`` sets for 64-row groups (no dense keys). ``decode.mla_decode`` sends
those launches here on an sm_90 GPU and keeps the Triton kernel for the rest, for the interpreter
and as the fallback (``LATENTSPEED_MLA_DECODE_SM90=0``). 16-bit caches' 64-row groups go to
``decode_sm90_seesaw`` (this kernel's schedule took them until 2026-12-02: 1.07-1.12x slower).

Why a second kernel: for ``S = Q K^T`` chained into ``P V`` Triton gives both warpgroups the
whole ``[64, BLOCK_N]`` score tile, so each computes all of ``Q K^T`` and the 8-warp program
issues twice the ``Q K^T`` work it needs (``benchmarks/notes.md``, 2026-12-01). Here the layouts
are explicit:

- ``Q K^T``: wgmma, warpgroups split the tile by keys (``warps_per_cta = [4, 2]``), so each
  computes ``[64, BLOCK_N / 2]`` from the queries in shared memory and its half of the keys;
- softmax in fp32, base 2; the row max reduces across both warpgroups every tile, the row sum
  once at the end (each thread keeps its score elements' running sums);
- ``P`` goes to shared memory in fp16;
- ``P V``: wgmma, warpgroups split the 512 latent columns, each holds ``[64, 256]`` fp32;
- cache tiles: ``cp.async`` per row (pages are not contiguous) into a ring of ``NUM_BUFS``
  shared buffers, ``NUM_BUFS - 1`` tiles in flight ahead of the one being used, their page ids
  read one tile earlier still.

Measured on the H200 (``benchmarks/notes.md``, 2026-12-01, fifth session): 32-token tiles with
three or four buffers were 1.4x slower (the per-tile synchronization dominates), and issuing
``P V`` of tile i back to back with ``Q K^T`` of tile i + 1 was 5-10 % slower (the next copy then
starts a tile later).

``Q K^T`` is one fp8 wgmma over E4M3 queries (rounded as the Triton kernel rounds them) and the
fp8 keys as they are in shared memory. fp8 wgmma reads only K-major operands, so each tile's
latent part is also widened to fp16 (exact) into a ``V`` buffer for ``P V``, while ``Q K^T``
runs.

Shared memory at ``BLOCK_N = 64``, two buffers: queries 36 KiB, tiles 2 x 36 KiB, ``V`` 64 KiB,
``P`` 8 KiB.
"""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ..fp8_format import FP8_DTYPES

BLOCK_R = 64
BLOCK_N = 64
NUM_BUFS = 2
D_LATENT = 512
D_ROPE = 64
NUM_WARPS = 8
V_CHUNK = gl.constexpr(128)  # fp8 caches: latent columns widened per step (bounds the registers it takes)


def fits(block_rows: int, keys_dtype: torch.dtype, paged: bool, page_size: int, d_latent: int, d_rope: int) -> bool:
    """Whether this kernel takes a launch of that shape (on an sm_90 GPU)."""
    return (block_rows == BLOCK_R and keys_dtype in FP8_DTYPES and paged
            and page_size % BLOCK_N == 0 and (d_latent, d_rope) == (D_LATENT, D_ROPE))


@gluon.jit
def _page_of(bt_row, n0, end, PAGE_SIZE: gl.constexpr):
    """The page holding token ``n0`` (clamped into ``[0, end)``, so always a valid block-table entry)."""
    return gl.load(bt_row + gl.maximum(gl.minimum(n0, end - 1), 0) // PAGE_SIZE).to(gl.int64)


@gluon.jit
def _issue_tile(kc_ring, kp_ring, slot, n0, end, cache_ptr, page, stride_cache_block, stride_cache_tok,
                PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, D_LATENT: gl.constexpr, D_ROPE: gl.constexpr,
                ld_layout: gl.constexpr):
    """Start copying cache tokens ``[n0, n0 + BLOCK_N)`` below ``end``, from ``page``, into ring slot
    ``slot`` (the rest of the slot is zero-filled, nothing read for it) as one commit group."""
    offs_tok = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld_layout))
    offs_c = gl.arange(0, D_LATENT, layout=gl.SliceLayout(0, ld_layout))
    offs_p = gl.arange(0, D_ROPE, layout=gl.SliceLayout(0, ld_layout))
    rows = cache_ptr + page * stride_cache_block + (offs_tok % PAGE_SIZE)[:, None].to(gl.int64) * stride_cache_tok
    in_range = (offs_tok < end)[:, None]
    async_copy.async_copy_global_to_shared(kc_ring.index(slot), rows + offs_c[None, :], mask=in_range)
    async_copy.async_copy_global_to_shared(kp_ring.index(slot), rows + D_LATENT + offs_p[None, :], mask=in_range)
    async_copy.commit_group()


@gluon.jit
def _start_ring(kc_ring, kp_ring, start, end, cache_ptr, bt_row, stride_cache_block, stride_cache_tok,
                PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, D_LATENT: gl.constexpr, D_ROPE: gl.constexpr,
                NUM_BUFS: gl.constexpr, ld_layout: gl.constexpr):
    """Issue the first ``NUM_BUFS - 1`` tiles of ``[start, end)``; return the page of the next one
    (page ids are read one tile ahead of their copies, so no copy waits on a block-table load)."""
    for t in gl.static_range(NUM_BUFS - 1):
        _issue_tile(kc_ring, kp_ring, t, start + t * BLOCK_N, end, cache_ptr,
                    _page_of(bt_row, start + t * BLOCK_N, end, PAGE_SIZE), stride_cache_block, stride_cache_tok,
                    PAGE_SIZE, BLOCK_N, D_LATENT, D_ROPE, ld_layout)
    return _page_of(bt_row, start + (NUM_BUFS - 1) * BLOCK_N, end, PAGE_SIZE)


@gluon.jit
def _advance_ring(kc_ring, kp_ring, i, page, start, end, cache_ptr, bt_row, stride_cache_block, stride_cache_tok,
                  PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, D_LATENT: gl.constexpr, D_ROPE: gl.constexpr,
                  NUM_BUFS: gl.constexpr, ld_layout: gl.constexpr):
    """Before tile ``i``: wait until it has landed for every thread and every thread is done with
    tile ``i - 1``, then refill that slot with tile ``i + NUM_BUFS - 1`` from ``page`` (past the
    end: an empty group, so the count stays uniform). Returns the page of the tile after it."""
    async_copy.wait_group(NUM_BUFS - 2)
    fence_async_shared()
    gl.thread_barrier()
    page_next = _page_of(bt_row, start + (i + NUM_BUFS) * BLOCK_N, end, PAGE_SIZE)
    _issue_tile(kc_ring, kp_ring, (i + NUM_BUFS - 1) % NUM_BUFS, start + (i + NUM_BUFS - 1) * BLOCK_N, end,
                cache_ptr, page, stride_cache_block, stride_cache_tok, PAGE_SIZE, BLOCK_N, D_LATENT, D_ROPE, ld_layout)
    return page_next


@gluon.jit
def _load_queries(q_nope_ptr, q_pe_ptr, q_start, q_len, pid_g, stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h,
                  NUM_HEADS: gl.constexpr, D_LATENT: gl.constexpr, D_ROPE: gl.constexpr, BLOCK_R: gl.constexpr,
                  IS_FP8: gl.constexpr, ld_layout: gl.constexpr):
    """The group's query rows (row r of the request is token r // H, head r % H, the Triton
    kernel's numbering) as ``Q K^T`` reads them, and the power of two per row they were scaled by.

    fp8 caches: the Triton kernel's query rounding, a power of two per row bringing max|row| into
    [128, 256) (exact), then E4M3 round-to-nearest-even; scores are scaled back by kv_scale / q_scale.
    """
    offs_r = pid_g * BLOCK_R + gl.arange(0, BLOCK_R, layout=gl.SliceLayout(1, ld_layout))
    mask_r = (offs_r < q_len * NUM_HEADS)[:, None]
    q_rows = (q_start + offs_r // NUM_HEADS)[:, None]
    heads = (offs_r % NUM_HEADS)[:, None]
    offs_c = gl.arange(0, D_LATENT, layout=gl.SliceLayout(0, ld_layout))
    offs_p = gl.arange(0, D_ROPE, layout=gl.SliceLayout(0, ld_layout))
    q_nope = gl.load(q_nope_ptr + q_rows * stride_qn_t + heads * stride_qn_h + offs_c[None, :], mask=mask_r, other=0.0)
    q_pe = gl.load(q_pe_ptr + q_rows * stride_qp_t + heads * stride_qp_h + offs_p[None, :], mask=mask_r, other=0.0)
    q_scale = gl.full([BLOCK_R], 1.0, gl.float32, layout=gl.SliceLayout(1, ld_layout))
    if IS_FP8:
        q_max = gl.maximum(gl.max(gl.abs(q_nope.to(gl.float32)), axis=1), gl.max(gl.abs(q_pe.to(gl.float32)), axis=1))
        q_exp = ((gl.maximum(q_max, 1e-30).to(gl.int32, bitcast=True) >> 23) & 0xFF) - 127
        q_scale = ((127 + 7 - q_exp) << 23).to(gl.float32, bitcast=True)
        q_nope = (q_nope.to(gl.float32) * q_scale[:, None]).to(gl.float8e4nv)
        q_pe = (q_pe.to(gl.float32) * q_scale[:, None]).to(gl.float8e4nv)
    return q_nope, q_pe, q_scale


@gluon.jit
def _widen_latent(kc, v_smem, ld_layout: gl.constexpr, D_LATENT: gl.constexpr):
    """An fp8 tile's latent part into ``v_smem`` in fp16 (exact), ``V_CHUNK`` columns at a time."""
    for c in gl.static_range(D_LATENT // V_CHUNK):
        v_part = kc.slice(c * V_CHUNK, V_CHUNK, dim=1).load(ld_layout)
        v_smem.slice(c * V_CHUNK, V_CHUNK, dim=1).store(v_part.to(v_smem.dtype))


@gluon.jit
def mla_decode_split_kernel_sm90(
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
    NUM_HEADS: gl.constexpr,
    D_LATENT: gl.constexpr,
    D_ROPE: gl.constexpr,
    PAGE_SIZE: gl.constexpr,
    BLOCK_R: gl.constexpr,
    BLOCK_N: gl.constexpr,
    IS_FP8: gl.constexpr,
    FP8_QUERIES: gl.constexpr,
    DIRECT_OUT: gl.constexpr,
    TREE_MASK: gl.constexpr,
    VARLEN: gl.constexpr,
    PREFIX_ONLY: gl.constexpr,
    KEYS_DENSE: gl.constexpr,
    NUM_BUFS: gl.constexpr,
):
    gl.static_assert(IS_FP8 and FP8_QUERIES and not KEYS_DENSE, "paged fp8 caches with fp8 queries")
    gl.static_assert(BLOCK_R == 64 and PAGE_SIZE % BLOCK_N == 0 and NUM_BUFS >= 2)
    key_ty: gl.constexpr = cache_ptr.dtype.element_ty
    # Q K^T operands: E4M3 queries; P V operands: fp16 P and the widened V.
    qk_ty: gl.constexpr = gl.float8e4nv
    pv_ty: gl.constexpr = gl.float16
    ld_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
    ld_keys: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [gl.num_warps(), 1], [1, 0])  # 16-byte copies
    mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                    instr_shape=[16, BLOCK_N // 2, 32])
    mma_o: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                    instr_shape=[16, D_LATENT // 2, 16])
    rows_s: gl.constexpr = gl.SliceLayout(1, mma_s)
    rows_o: gl.constexpr = gl.SliceLayout(1, mma_o)

    pid_g = gl.program_id(0)
    pid_s = gl.program_id(1)
    pid_b = gl.program_id(2).to(gl.int64)
    num_splits = gl.num_programs(1)
    if VARLEN:
        q_start_32 = gl.load(q_start_ptr + pid_b)
        q_len = gl.load(q_start_ptr + pid_b + 1) - q_start_32
        q_start = q_start_32.to(gl.int64)
    else:
        q_start = pid_b * uniform_q_len
        q_len = uniform_q_len
    seq_len = gl.load(seq_lens_ptr + pid_b)
    draft_start = seq_len - q_len
    num_keys = draft_start if PREFIX_ONLY else seq_len
    split_len = gl.cdiv(gl.cdiv(num_keys, num_splits), BLOCK_N) * BLOCK_N
    start = pid_s * split_len
    end = gl.minimum(start + split_len, num_keys)

    q_nope, q_pe, q_scale = _load_queries(q_nope_ptr, q_pe_ptr, q_start, q_len, pid_g, stride_qn_t, stride_qn_h,
                                          stride_qp_t, stride_qp_h, NUM_HEADS, D_LATENT, D_ROPE, BLOCK_R, IS_FP8,
                                          ld_layout)
    kv_scale = gl.load(kv_scale_ptr)
    score_scale = gl.convert_layout(qk_scale_log2 * kv_scale / q_scale, rows_s)[:, None]
    qn_smem = gl.allocate_shared_memory(qk_ty, [BLOCK_R, D_LATENT],
                                        gl.NVMMASharedLayout.get_default_for([BLOCK_R, D_LATENT], qk_ty), q_nope)
    qp_smem = gl.allocate_shared_memory(qk_ty, [BLOCK_R, D_ROPE],
                                        gl.NVMMASharedLayout.get_default_for([BLOCK_R, D_ROPE], qk_ty), q_pe)
    kc_ring = gl.allocate_shared_memory(key_ty, [NUM_BUFS, BLOCK_N, D_LATENT],
                                        gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_LATENT], key_ty))
    kp_ring = gl.allocate_shared_memory(key_ty, [NUM_BUFS, BLOCK_N, D_ROPE],
                                        gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_ROPE], key_ty))
    p_smem = gl.allocate_shared_memory(pv_ty, [BLOCK_R, BLOCK_N],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_R, BLOCK_N], pv_ty))
    # fp8 wgmma reads B K-major only: V (keys along K) is widened into fp16 each tile
    v_smem = gl.allocate_shared_memory(pv_ty, [BLOCK_N, D_LATENT],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_LATENT], pv_ty))

    # Row visibility, in the score layout: causal bound, or tree mask bits.
    row_s = pid_g * BLOCK_R + gl.arange(0, BLOCK_R, layout=rows_s)
    tok_j = row_s // NUM_HEADS
    if TREE_MASK:
        mask_bits = gl.load(tree_mask_ptr + q_start + tok_j, mask=row_s < q_len * NUM_HEADS, other=0)
    else:
        visible = draft_start + 1 + tok_j

    bt_row = block_table_ptr + pid_b * stride_bt_b
    page = _start_ring(kc_ring, kp_ring, start, end, cache_ptr, bt_row, stride_cache_block, stride_cache_tok, PAGE_SIZE,
                       BLOCK_N, D_LATENT, D_ROPE, NUM_BUFS, ld_keys)

    m_i = gl.full([BLOCK_R], float("-inf"), gl.float32, layout=rows_s)
    # The row sums stay per score element until the end: no reduction across warpgroups per tile.
    l_tile = gl.zeros([BLOCK_R, BLOCK_N], gl.float32, layout=mma_s)
    acc = gl.zeros([BLOCK_R, D_LATENT], gl.float32, layout=mma_o)
    s_zero = gl.zeros([BLOCK_R, BLOCK_N], gl.float32, layout=mma_s)
    offs_key = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma_s))
    n_tiles = gl.cdiv(gl.maximum(end - start, 0), BLOCK_N)
    for i in range(n_tiles):
        page = _advance_ring(kc_ring, kp_ring, i, page, start, end, cache_ptr, bt_row, stride_cache_block,
                             stride_cache_tok, PAGE_SIZE, BLOCK_N, D_LATENT, D_ROPE, NUM_BUFS, ld_keys)
        kc = kc_ring.index(i % NUM_BUFS)
        kp = kp_ring.index(i % NUM_BUFS)

        s = warpgroup_mma(qn_smem, kc.permute([1, 0]), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma(qp_smem, kp.permute([1, 0]), s, is_async=True)
        _widen_latent(kc, v_smem, ld_keys, D_LATENT)  # while Q K^T runs
        s, _, _, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=[s, qn_smem, qp_smem, kc, kp])

        offs_n = start + i * BLOCK_N + offs_key
        if TREE_MASK:
            draft_k = offs_n - draft_start
            in_tree = ((mask_bits[:, None] >> gl.maximum(draft_k, 0)[None, :].to(gl.int64)) & 1) != 0
            seen = (offs_n < end)[None, :] & ((draft_k < 0)[None, :] | in_tree)
        elif PREFIX_ONLY:
            seen = (offs_n < end)[None, :]
        else:
            seen = (offs_n < end)[None, :] & (offs_n[None, :] < visible[:, None])
        s = gl.where(seen, s * score_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        m_shift = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_shift)
        p = gl.exp2(s - m_shift[:, None])
        l_tile = l_tile * alpha[:, None] + p
        m_i = m_new

        p_smem.store(p.to(pv_ty))
        fence_async_shared()
        gl.thread_barrier()  # all of P (and V) is written before either warpgroup reads it
        acc = warpgroup_mma(p_smem, v_smem, acc * gl.convert_layout(alpha, rows_o)[:, None], is_async=True)
        acc, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=[acc, p_smem, v_smem])
    async_copy.wait_group(0)

    l_i = gl.sum(l_tile, axis=1)
    has_keys = l_i > 0.0
    safe_l = gl.where(has_keys, l_i, 1.0)
    lse = gl.where(has_keys, (m_i + gl.log2(safe_l)) * 0.6931471805599453, float("-inf"))  # ln 2
    out = acc * gl.convert_layout(kv_scale / safe_l, rows_o)[:, None]

    row_o = pid_g * BLOCK_R + gl.arange(0, BLOCK_R, layout=rows_o)
    out_rows = (q_start + row_o // NUM_HEADS)[:, None] * stride_out_t + (row_o % NUM_HEADS)[:, None] * stride_out_h
    offs_co = gl.arange(0, D_LATENT, layout=gl.SliceLayout(0, mma_o))
    out_mask = (row_o < q_len * NUM_HEADS)[:, None]
    lse_ptrs = lse_ptr + (q_start + tok_j) * stride_lse_t + (row_s % NUM_HEADS) * stride_lse_h
    lse_mask = row_s < q_len * NUM_HEADS
    if DIRECT_OUT:
        gl.store(out_ptr + out_rows + offs_co[None, :], out.to(out_ptr.dtype.element_ty), mask=out_mask)
        gl.store(lse_ptrs, lse, mask=lse_mask)
    else:
        gl.store(out_ptr + out_rows + pid_s * stride_out_s + offs_co[None, :], out, mask=out_mask)
        gl.store(lse_ptrs + pid_s, lse, mask=lse_mask)
