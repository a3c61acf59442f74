"""What the Gluon decode kernels for sm_90 share: the latent and RoPE widths they take, a
program's split of the keys, the page lookup, the rings of cache tiles of ``decode_sm90_narrow``
(``cp.async`` per row, or bulk tensor copies), the query load with the fp8 caches' query
rounding, and ``P V`` as ``O^T = V^T P^T`` with ``V^T`` from registers (``_pv``; in fp8 over fp8
caches, ``FP8_PV``) and its output rows (``_store_out``) (both kernels).
"""

import os

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
)

from ..fp8_format import FP8_DTYPES

D_LATENT = 512
D_ROPE = 64
V_CHUNK = gl.constexpr(128)  # fp8 caches: latent columns widened per step (bounds the registers it takes)
FP8_PV_ENV = "LATENTSPEED_MLA_DECODE_FP8_PV"  # "0": P V in fp16 (V widened) over fp8 caches, in both kernels
P_SCALE = gl.constexpr(256.0)  # P in [0, 1] to [0, 256]: normal in E4M3 and E5M2, below their maxima (448, 57344)


def fp8_pv_allowed(cache_dtype: torch.dtype) -> bool:
    """Whether ``P V`` may run in fp8 over a cache of that dtype: fp8 caches, unless
    ``LATENTSPEED_MLA_DECODE_FP8_PV=0``. (Each kernel's ``fp8_pv`` adds its own switch.)"""
    return cache_dtype in FP8_DTYPES and os.environ.get(FP8_PV_ENV, "1") != "0"


@gluon.jit
def _program_split(q_start_ptr, seq_lens_ptr, uniform_q_len, BLOCK_N: gl.constexpr, VARLEN: gl.constexpr,
                   PREFIX_ONLY: gl.constexpr):
    """This program's row group, split and request, the request's query rows (``q_start``,
    ``q_len``), where its draft tokens start, and the keys ``[start, end)`` of its split (grid
    ``(row groups, splits, requests)``; splits a multiple of ``BLOCK_N`` long)."""
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
    return pid_g, pid_s, pid_b, q_start, q_len, draft_start, start, end


@gluon.jit
def _named_barrier(ASM: gl.constexpr):
    """A named barrier over the warpgroups of a warp-specialized kernel: ``ASM`` is ``bar.sync ID, THREADS``
    or ``bar.arrive ID, THREADS`` followed by ``mov.u32 $0, 0;`` (Triton's own barriers use ids 0, 1 and
    2 + the worker partition's index)."""
    gl.inline_asm_elementwise(ASM, "=r", [], dtype=gl.int32, is_pure=False, pack=1)


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
def _issue_tile_tma(kc_desc, kp_desc, kc_ring, kp_ring, bars, slot, n0, page, pred, PAGE_SIZE: gl.constexpr,
                    D_LATENT: gl.constexpr, BOX: gl.constexpr):
    """Start the bulk tensor copies (TMA) of cache tokens ``[n0, n0 + BLOCK_N)`` of ``page`` into ring
    slot ``slot``, completing on its barrier (nothing when ``pred`` is false). Rows past the
    split's end come from the page as they are (``_zero_tail`` clears their latent part)."""
    bar = bars.index(slot)
    row = (page * PAGE_SIZE + n0 % PAGE_SIZE).to(gl.int32)
    TILE_BYTES: gl.constexpr = ((kc_ring.shape[1] * kc_ring.shape[2] + kp_ring.shape[1] * kp_ring.shape[2])
                                * kc_ring.dtype.primitive_bitwidth // 8)
    mbarrier.expect(bar, TILE_BYTES, pred=pred)
    for j in gl.static_range(D_LATENT // BOX):
        tma.async_copy_global_to_shared(kc_desc, [row, j * BOX], bar, kc_ring.index(slot).slice(j * BOX, BOX, dim=1),
                                        pred=pred)
    tma.async_copy_global_to_shared(kp_desc, [row, D_LATENT], bar, kp_ring.index(slot), pred=pred)


@gluon.jit
def _start_ring_tma(kc_desc, kp_desc, kc_ring, kp_ring, bars, start, end, bt_row, PAGE_SIZE: gl.constexpr,
                    BLOCK_N: gl.constexpr, D_LATENT: gl.constexpr, NUM_BUFS: gl.constexpr, BOX: gl.constexpr,
                    STEP: gl.constexpr = 1):
    """``_start_ring`` with bulk tensor copies: one barrier a slot, tiles at or past ``end`` not copied.
    ``STEP`` consumers take turns at the tiles: the first ``NUM_BUFS - STEP`` are issued here, the
    others by each consumer's first ``_refill_tma``. Returns the page of tile ``NUM_BUFS - STEP``."""
    for t in gl.static_range(NUM_BUFS):
        mbarrier.init(bars.index(t), count=1)
    fence_async_shared()
    for t in gl.static_range(NUM_BUFS - STEP):
        n0 = start + t * BLOCK_N
        _issue_tile_tma(kc_desc, kp_desc, kc_ring, kp_ring, bars, t, n0, _page_of(bt_row, n0, end, PAGE_SIZE),
                        n0 < end, PAGE_SIZE, D_LATENT, BOX)
    return _page_of(bt_row, start + (NUM_BUFS - STEP) * BLOCK_N, end, PAGE_SIZE)


@gluon.jit
def _wait_tile_tma(kc_ring, bars, i, start, end, BLOCK_N: gl.constexpr, D_LATENT: gl.constexpr,
                   NUM_BUFS: gl.constexpr):
    """Wait for tile ``i``'s bulk copies and zero its latent rows past ``end``."""
    mbarrier.wait(bars.index(i % NUM_BUFS), (i // NUM_BUFS) & 1)
    rows_left = end - (start + i * BLOCK_N)
    if rows_left < BLOCK_N:
        _zero_tail(kc_ring.index(i % NUM_BUFS), rows_left, BLOCK_N, D_LATENT)


@gluon.jit
def _refill_tma(kc_desc, kp_desc, kc_ring, kp_ring, bars, i, page, start, end, bt_row, PAGE_SIZE: gl.constexpr,
                BLOCK_N: gl.constexpr, D_LATENT: gl.constexpr, NUM_BUFS: gl.constexpr, BOX: gl.constexpr,
                STEP: gl.constexpr = 1):
    """Once every thread of this consumer is done with its previous tile ``i - STEP`` (past a barrier
    of tile ``i``; ``STEP`` consumers take turns): refill that slot with tile ``i - STEP + NUM_BUFS``
    from ``page``. Returns the page of this consumer's next refill, tile ``i + NUM_BUFS``."""
    page_next = _page_of(bt_row, start + (i + NUM_BUFS) * BLOCK_N, end, PAGE_SIZE)
    n0 = start + (i - STEP + NUM_BUFS) * BLOCK_N
    _issue_tile_tma(kc_desc, kp_desc, kc_ring, kp_ring, bars, (i - STEP + NUM_BUFS) % NUM_BUFS, n0, page, n0 < end,
                    PAGE_SIZE, D_LATENT, BOX)
    return page_next


@gluon.jit
def _zero_tail(kc, rows_left, BLOCK_N: gl.constexpr, D_LATENT: gl.constexpr):
    """Zero the latent part of the tile's rows from ``rows_left`` on: a page's rows past the keys are
    stale or never written (possibly NaN), and ``P V`` multiplies them by zero. Works on 32-bit words
    of an int32 view of the slot (whole words of one row: the 128-byte swizzle keeps each row in its
    own 128-byte lines); selecting fp8 elements would be lowered byte by byte."""
    CHUNK: gl.constexpr = 32
    WORDS: gl.constexpr = D_LATENT * kc.dtype.primitive_bitwidth // 32
    words: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [gl.num_warps(), 1], [1, 0])
    kw = kc._reinterpret(gl.int32, [BLOCK_N, WORDS], gl.NVMMASharedLayout.get_default_for([BLOCK_N, WORDS], gl.int32))
    keep = (gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, words)) < rows_left)[:, None]
    for j in gl.static_range(WORDS // CHUNK):
        part = kw.slice(j * CHUNK, CHUNK, dim=1)
        part.store(gl.where(keep, part.load(words), gl.zeros([BLOCK_N, CHUNK], gl.int32, words)))
    fence_async_shared()
    gl.thread_barrier()


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


@gluon.constexpr_function
def _v_words(BLOCK_N):
    """fp8 ``P V``: a ``[BLOCK_N keys, V_CHUNK latent]`` tile part in the registers that ``_pv`` reorders into
    ``V^T``'s wgmma operand (4 warps, ``BLOCK_N = 64``), four latent bytes a word."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [1, 0], [2, 0], [16, 0], [32, 0]],
        lane_bases=[[4, 0], [8, 0], [0, 4], [0, 8], [0, 16]],
        warp_bases=[[0, 32], [0, 64]], block_bases=[], shape=[BLOCK_N, V_CHUNK])


@gluon.jit
def _pv(tile, c: gl.constexpr, p_op, acc, IS_FP8: gl.constexpr, FP8_PV: gl.constexpr, v_ops: gl.constexpr,
        v_words: gl.constexpr):
    """Start ``acc += V^T P^T`` for latent chunk ``c`` (``V_CHUNK`` columns) of the cache ``tile``.
    16-bit tiles: ``V^T`` read transposed from shared memory by wgmma. fp8 tiles: ``V^T`` loaded
    into registers, with ``FP8_PV`` four latent bytes a word (``v_words``), its rows reordered so that
    the words need no exchange between threads and are used as they are (the bits ``m0 ... m6`` of row
    ``m``, low first, hold latent bits ``l2 l3 l4 l0 l5 l6 l1``: each thread's rows ``m``, ``m + 8``,
    ``m + 64``, ``m + 72`` are four adjacent bytes of a key's row; ``O^T``'s rows come out in that order),
    else a byte a load and widened to fp16. Returns the accumulator and ``V^T``'s operand (alive
    until the wgmma is waited for)."""
    if FP8_PV:
        keys: gl.constexpr = tile.shape[0]
        v = tile.slice(c * V_CHUNK, V_CHUNK, dim=1).load(v_words)  # [keys, V_CHUNK latent]
        v = gl.permute(gl.reshape(v, [keys, 2, 2, 2, 2, 2, 2, 2]), [6, 1, 2, 7, 3, 4, 5, 0])
        v_regs = gl.convert_layout(gl.reshape(v, [V_CHUNK, keys]), v_ops)
        return warpgroup_mma(v_regs, p_op, acc, is_async=True), v_regs
    v_t = tile.slice(c * V_CHUNK, V_CHUNK, dim=1).permute([1, 0])
    if IS_FP8:
        v_regs = v_t.load(v_ops).to(p_op.dtype)
        return warpgroup_mma(v_regs, p_op, acc, is_async=True), v_regs
    else:
        return warpgroup_mma(v_t, p_op, acc, is_async=True), v_t


@gluon.constexpr_function
def _store_layout(rows):
    """A chunk of ``O^T`` (``[V_CHUNK latent, rows]``, 4 warps) as ``_store_out`` writes it: each thread four
    adjacent latent columns of a row, a warp's lanes the chunk's 128 columns in order, the warps and registers
    the rows."""
    row_regs = [[0, 1 << bit] for bit in range(2, rows.bit_length() - 1)]
    return gl.DistributedLinearLayout(reg_bases=[[1, 0], [2, 0]] + row_regs,
                                      lane_bases=[[4, 0], [8, 0], [16, 0], [32, 0], [64, 0]],
                                      warp_bases=[[0, 1], [0, 2]], block_bases=[], shape=[V_CHUNK, rows])


@gluon.jit
def _store_out(out, c: gl.constexpr, out_ptr, out_rows, out_ok, FP8_PV: gl.constexpr):
    """Chunk ``c`` of ``O^T`` (``[V_CHUNK, rows]``; ``FP8_PV``: its rows in ``_pv``'s order) to the
    output rows at ``out_ptr + out_rows`` where ``out_ok``. Regrouped through shared memory first
    (``_store_layout``): in the accumulator's layout a thread holds two rows' elements, so every element
    would be a store of its own, one 32-byte sector each."""
    rows: gl.constexpr = out.shape[1]
    if FP8_PV:  # the rows back in latent order (a renaming of the registers): the row index's bits, most
        # significant first, for latent bits l6 ... l0 (``_pv``'s order inverted), then the rows' axis
        out = gl.reshape(gl.permute(gl.reshape(out, [2, 2, 2, 2, 2, 2, 2, rows]), [1, 2, 4, 5, 6, 0, 3, 7]),
                         [V_CHUNK, rows])
    store: gl.constexpr = _store_layout(rows)
    out = gl.convert_layout(out.to(out_ptr.dtype.element_ty), store)
    offs_co = c * V_CHUNK + gl.arange(0, V_CHUNK, layout=gl.SliceLayout(1, store))
    # whole 16-byte groups of four: ``decode.mla_decode`` checks the output's strides (a partition's
    # arguments carry no divisibility of their own)
    rows_o = gl.multiple_of(gl.convert_layout(out_rows, gl.SliceLayout(0, store)), 4)[None, :]
    ok = gl.convert_layout(out_ok, gl.SliceLayout(0, store))[None, :]
    gl.store(out_ptr + rows_o + offs_co[:, None], out, mask=ok)
