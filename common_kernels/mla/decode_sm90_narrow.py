"""The MLA decode split kernel for Hopper (sm_90), in Gluon: 16- and 32-row groups, scores transposed.

Same contract, arguments and partial outputs as ``decode._mla_decode_split_kernel`` (the module
docstring of ``decode`` has the formula), for the launches it takes: ``BLOCK_R`` of 16 or 32
rows, ``D_latent = 512``, ``D_rope = 64``, a paged cache (bf16/fp16, or fp8 with E4M3 queries,
``DecodePlan.fp8_queries``, with ``P`` rounded to the cache's format, ``DecodePlan.fp8_probs``; no
dense keys). ``decode.mla_decode`` sends those launches here on an
sm_90 GPU when the plan was made for it (``plan_decode(..., sm90=True)``).

Why: wgmma's M is 64, so a 64-row kernel (``decode_sm90_seesaw``) run on 16 rows computes 48 rows of
padding, and at 16 heads it is bound by that compute, not by the cache read. Here the keys are
wgmma's M and the query rows its N (one warpgroup, 4 warps):

- ``S^T = K Q^T``: ``[BLOCK_N keys, BLOCK_R rows]``, the cache tile as the left operand straight
  from shared memory (fp8 tiles too: they are K-major), the queries as the right one;
- softmax per column in fp32, base 2; the column max reduces across the 4 warps every tile (each
  warp's maximum through shared memory, one barrier: ``_column_max``), the column sum once at the
  end;
- ``P^T`` goes to shared memory in the ``P V`` operand type;
- ``O^T = V^T P^T``: ``[D_latent, BLOCK_R]`` fp32 in four accumulators of ``V_CHUNK`` latent
  rows, ``V^T`` the tile's latent part read transposed from shared memory by wgmma (bf16/fp16).
  An fp8 wgmma operand in shared memory must be K-major, so fp8 ``V^T`` comes from registers:
  in fp8 (``FP8_PV``), ``P^T`` rounded to the cache's format (E5M2 ``V`` by E4M3 ``P`` does not
  lower) after scaling by ``P_SCALE``, relative to a whole power-of-two shift (the column maximum
  rounded up), so that the rounding does not depend on which running or per-split maximum the
  shift came from (``reference.fp8_probs_weights``); ``V^T`` is loaded four latent bytes a word
  with its rows reordered (``sm90_common._pv``) so that no bytes move between threads. Against the
  fp16 ``P V`` (H200, both orders): E4M3 1.00-1.16x faster at one query token and 1.07-1.20x at
  two, for about 1.4e-2 more relative error
  (``benchmarks/results/mla_decode-sm90-narrow-fp8pv-2026-12-03.md``); E5M2 1.00-1.17x and
  1.07-1.23x, for about 3.7e-2 more (``mla_decode-sm90-narrow-e5m2p-2026-12-03.md``). With
  ``LATENTSPEED_MLA_DECODE_FP8_PV=0``, ``V^T`` is loaded a byte at a time and widened to fp16
  (exact; word loads with the reordering were 0.89-1.00x, widening into a shared buffer cost as
  much as the halved read saved). There, at 32 rows, only two ``V^T`` chunks are in flight (chunk
  c is waited for before c + 2 is issued): with four, the accumulators and operands outgrow the
  registers and ptxas serializes every wgmma (C7511); two were 1.18-1.22x faster on the H200
  (2026-12-01, ninth session);
- cache tiles into a ring of ``NUM_BUFS`` buffers (``sm90_common``): fp8 caches whose pages lie
  back to back by bulk tensor copies (TMA, five boxes a tile, one barrier a slot; the latent rows
  of a split's last tile past its keys are zeroed in shared memory; a slot is refilled once the
  column-max barrier of the next tile shows every thread done with it, which spares a barrier a
  tile), others by ``cp.async`` per row. Nsight Compute on the H200 put 16 % of the fp8 kernel's
  stall samples on issuing 18 ``cp.async`` a thread a tile
  (``benchmarks/results/ncu-decode-gemm-2026-12-02.json``).

Paired programs (``CONSUMERS = 2``; fp8 caches with bulk copies, ``launch_options``): two
warpgroups (``gl.warp_specialize``) take turns at the tiles of one split, tile ``i`` from slot
``i % PAIRED_BUFS`` of one ring of five; each warpgroup refills the slot of its own previous tile
with the tile ``PAIRED_BUFS`` after it (the other warpgroup's, the ring being odd), and keeps its
own softmax state. At the end warpgroup 1 leaves its maximum, row sums and ``O^T`` in the idle
ring and warpgroup 0 merges them (exact under ``FP8_PV``: both maxima are whole numbers) and
stores. One program a multiprocessor, so at batch 128 a request is one split and needs no merge
kernel. Against two one-warpgroup programs a multiprocessor (H200, both orders,
``benchmarks/results/mla_decode-sm90-narrow-paired-2026-12-03.md``): 1.06-1.08x at one query token
and 4k, 1.10-1.11x at two tokens, about level at 32k. That build raced (its PTX: a warpgroup done
early ran a reduction whose barrier id Triton had given the other partition's loop); ``_consumer``
now runs the two warpgroups' post-loop code one after the other, and the GPU tests pass with it
(``benchmarks/results/mla_decode-sm90-narrow-paired-default-2026-12-03.md``). Plans pair where
splits are long (``pairs``); ``LATENTSPEED_MLA_DECODE_PAIRED=0`` never does.

Shared memory at ``BLOCK_N = 64``: bf16 queries 18 KiB (32 rows: 36), two tiles 144 KiB, one
program per multiprocessor; fp8 queries 9 KiB (32 rows: 18), unpaired two tiles 72 KiB, two
programs per multiprocessor (``PROGRAMS_PER_SM_FP8``), which hide each other's latencies: measured
on the H200 (``benchmarks/notes.md``, 2026-12-01, seventh session) 1.25-1.33x faster than one
program with the widening buffer at one query token; paired five tiles 180 KiB, 192 KiB in all
(32 rows: 204). (64-row groups with two warpgroups of 32 rows here were
1.08-1.15x slower than the 64-row kernel of the time in bf16 and 1.25-1.28x in fp8 on the H200:
``benchmarks/results/mla_decode-sm90-narrow64-2026-12-02.md``.)
"""

import functools
import os

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ..fp8_format import FP8_DTYPES
from .sm90_common import (
    D_LATENT,
    D_ROPE,
    P_SCALE,
    V_CHUNK,
    _advance_ring,
    _refill_tma,
    _load_queries,
    _named_barrier,
    _page_of,
    _program_split,
    _pv,
    _start_ring,
    _start_ring_tma,
    _store_layout,
    _store_out,
    _v_words,
    _wait_tile_tma,
    fp8_pv_allowed,
)

BLOCK_ROWS = (16, 32)
BLOCK_N = 64
NUM_WARPS = 4


NUM_BUFS = 2
# fp8 caches whose pages lie back to back: tiles by bulk tensor copies (TMA), 1.11-1.15x faster at one
# query token than cp.async per row, 1.03-1.04x at two, and with the refill moved behind the column
# max another 1.02-1.04x and 1.08-1.12x (benchmarks/results/mla_decode-sm90-narrow-tma-2026-12-02.md);
# 16-bit caches keep cp.async (0.97-1.00x with TMA, already at the card's bandwidth).
USE_TMA_FP8 = 1
TMA_ENV = "LATENTSPEED_MLA_DECODE_TMA"  # "0": cp.async for every cache
USE_FP8_PV = 1
PROGRAMS_PER_SM_FP8 = 2  # fp8 caches: 83 KiB of shared memory (32 rows: 94), 203-255 registers a thread
# fp8 caches by bulk copies: one program a multiprocessor with two warpgroups taking turns at the tiles
# of one ring of PAIRED_BUFS slots (192 KiB of shared memory; 32 rows: 204 KiB), instead of two programs,
# where every split reads at least MIN_TOKENS_PER_PAIRED_SPLIT tokens (``pairs``): a split of one or two
# tiles leaves the second warpgroup short of keys and still pays the hand-over (H200, batches 1 and 8,
# 512-4096 tokens, A/B: unpaired 1.02-1.19x faster there;
# benchmarks/results/mla_decode-sm90-narrow-paired-default-2026-12-03.md).
PAIRED_FP8 = 1
MIN_TOKENS_PER_PAIRED_SPLIT = 256
PAIRED_ENV = "LATENTSPEED_MLA_DECODE_PAIRED"  # "1": paired programs, "0": two one-warpgroup programs
PAIRED_BUFS = 5
PAIRED_REGS = 256  # registers a thread of either warpgroup (the launch's cap; 248 left 44 B of spills at 32 rows)
_PAIRED_REGS = gl.constexpr(PAIRED_REGS)
# Named barriers over both warpgroups of a paired program (Triton's own use ids 0, 1 and 2 + worker index).
SYNC_RING_DONE = gl.constexpr("bar.sync 8, 256; mov.u32 $0, 0;")
SYNC_HANDED_OVER = gl.constexpr("bar.sync 9, 256; mov.u32 $0, 0;")
ARRIVE_HANDED_OVER = gl.constexpr("bar.arrive 9, 256; mov.u32 $0, 0;")


def paired(fp8: bool) -> bool:
    """Whether fp8 launches that get bulk copies may run as paired programs:
    ``LATENTSPEED_MLA_DECODE_PAIRED`` (``1`` or ``0``) where set, else ``PAIRED_FP8``."""
    setting = os.environ.get(PAIRED_ENV)
    return fp8 and (bool(PAIRED_FP8) if setting is None else setting != "0")


def pairs(block_rows: int, fp8: bool, tokens_per_split: int) -> bool:
    """Whether a plan runs this kernel's launches as paired programs: fp8 caches under ``paired``
    whose splits read at least ``MIN_TOKENS_PER_PAIRED_SPLIT`` tokens. A cache that cannot take
    bulk copies runs unpaired on such a plan (``launch_options``)."""
    return block_rows in BLOCK_ROWS and paired(fp8) and tokens_per_split >= MIN_TOKENS_PER_PAIRED_SPLIT


def programs_per_sm(block_rows: int, fp8: bool, paired_programs: bool) -> int:
    """Programs a multiprocessor holds: two of this kernel's one-warpgroup fp8 launches, else one
    (the registers; a paired program takes the whole multiprocessor)."""
    return PROGRAMS_PER_SM_FP8 if fp8 and block_rows in BLOCK_ROWS and not paired_programs else 1


def fp8_pv(cache_dtype: torch.dtype) -> bool:
    """Whether this kernel runs ``P V`` in fp8 over a cache of that dtype (fp8 caches, unless
    ``LATENTSPEED_MLA_DECODE_FP8_PV=0``): ``P`` relative to a whole power-of-two shift, times
    ``P_SCALE``, rounded to the cache's format (``reference.mla_decode_ref(..., fp8_probs=True)``)."""
    return bool(USE_FP8_PV) and fp8_pv_allowed(cache_dtype)


def fits(block_rows: int, keys_dtype: torch.dtype, paged: bool, page_size: int, d_latent: int, d_rope: int) -> bool:
    """Whether this kernel takes a launch of that shape (on an sm_90 GPU)."""
    return (block_rows in BLOCK_ROWS and keys_dtype in (torch.bfloat16, torch.float16, *FP8_DTYPES) and paged
            and page_size % BLOCK_N == 0 and (d_latent, d_rope) == (D_LATENT, D_ROPE))


def launch_options(keys: torch.Tensor, fp8_probs: bool, paired_programs: bool) -> dict:
    """The kernel's launch options over the paged cache ``keys`` beyond the common arguments: the
    ring, the warps, ``FP8_PV`` (``DecodePlan.fp8_probs``), the bulk-copy descriptors where
    ``tma_options`` gives them, and with them, for ``paired_programs`` (``DecodePlan.paired``), two
    consumers a program."""
    options = dict(NUM_BUFS=NUM_BUFS, num_warps=NUM_WARPS, FP8_PV=fp8_probs, **tma_options(keys))
    if "TMA_BOX" in options and paired_programs:
        options.update(NUM_BUFS=PAIRED_BUFS, CONSUMERS=2, maxnreg=PAIRED_REGS)
    return options


_GL_FP8 = {torch.float8_e4m3fn: gl.float8e4nv, torch.float8_e5m2: gl.float8e5}
TMA_BOX = 128  # latent columns a box: 128 bytes of fp8, the 128-byte swizzle's width


@functools.cache
def _tile_layouts(dtype: torch.dtype) -> tuple[gl.NVMMASharedLayout, gl.NVMMASharedLayout]:
    """The shared layouts of a key tile's latent and RoPE parts (built once: host time every launch)."""
    return tuple(gl.NVMMASharedLayout.get_default_for([BLOCK_N, width], _GL_FP8[dtype]) for width in (D_LATENT, D_ROPE))


def tma_options(cache: torch.Tensor) -> dict:
    """The launch's bulk-copy arguments for a paged fp8 cache ``[N_blocks, B_page, D]`` whose pages
    lie back to back, 16-byte aligned (``USE_TMA_FP8``): two descriptors over its rows, boxes of
    ``BLOCK_N`` rows by 128 bytes (latent part) and by the RoPE part, in the shared layouts of the
    kernel's tiles. Else, or with ``LATENTSPEED_MLA_DECODE_TMA=0``, none (the kernel copies rows
    with ``cp.async``)."""
    blocks, page, width = cache.shape
    if (not USE_TMA_FP8 or os.environ.get(TMA_ENV, "1") == "0" or cache.dtype not in FP8_DTYPES
            or cache.stride(0) != page * cache.stride(1)
            or cache.stride(2) != 1 or cache.data_ptr() % 16 or cache.stride(1) * cache.element_size() % 16):
        return {}
    rows = cache.as_strided((blocks * page, width), (cache.stride(1), 1))
    latent, rope = _tile_layouts(cache.dtype)
    return dict(kc_desc=TensorDescriptor.from_tensor(rows, [BLOCK_N, TMA_BOX], latent),
                kp_desc=TensorDescriptor.from_tensor(rows, [BLOCK_N, D_ROPE], rope), TMA_BOX=TMA_BOX)


@gluon.jit
def _column_max(s, max_smem, BLOCK_N: gl.constexpr, BLOCK_R: gl.constexpr, mma_s: gl.constexpr):
    """The maximum of each column of ``S^T`` (keys along the 4 warps): each warp's own maximum into
    shared memory, one barrier, then each thread reads the four. (``gl.max(s, axis=0)`` takes two
    barriers.) The slots are rewritten a tile later, after the ``P`` barrier."""
    per_warp = gl.max(gl.reshape(s, [4, BLOCK_N // 4, BLOCK_R]), axis=1)
    max_smem.store(per_warp)
    gl.thread_barrier()
    return gl.max(max_smem.load(mma_s), axis=0)


@gluon.constexpr_function
def _scores_layout(BLOCK_R, IS_FP8):
    """``S^T``'s registers: keys along the 4 warps, query rows as wgmma's N."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                     instr_shape=[16, BLOCK_R, 32 if IS_FP8 else 16])


@gluon.constexpr_function
def _out_layout(BLOCK_R, FP8_PV):
    """``O^T``'s registers, one ``V_CHUNK``-row accumulator a chunk."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                     instr_shape=[16, BLOCK_R, 32 if FP8_PV else 16])


@gluon.jit
def _tiles(smem, bars, kc_desc, kp_desc, cache_ptr, bt_row, stride_cache_block, stride_cache_tok, tree_mask_ptr, pid_g,
           q_start, q_len, draft_start, start, end, page, score_scale, FIRST: gl.constexpr, STEP: gl.constexpr,
           NUM_HEADS: gl.constexpr, PAGE_SIZE: gl.constexpr, BLOCK_R: gl.constexpr, BLOCK_N: gl.constexpr,
           D_LATENT: gl.constexpr, D_ROPE: gl.constexpr, NUM_BUFS: gl.constexpr, TMA_BOX: gl.constexpr,
           IS_FP8: gl.constexpr, FP8_PV: gl.constexpr, TREE_MASK: gl.constexpr, PREFIX_ONLY: gl.constexpr):
    """One warpgroup's pass over tiles ``FIRST``, ``FIRST + STEP``, ... of the split ``[start, end)``
    (``STEP`` warpgroups take turns over one ring; more than one needs the bulk copies): the online
    softmax of the module docstring. ``smem``: the queries, the ring, this warpgroup's ``P`` and
    column-max buffers; ``bars``: the ring's barriers (bulk copies); ``page``: the page of this
    warpgroup's first refill.
    Returns the running maximum ``m`` (base 2), the row sums relative to it still spread over the
    keys of a tile (``[BLOCK_N, BLOCK_R]``: their sum across the warps takes barriers, which a
    paired program must not run while the other warpgroup is in this loop, ``_consumer``), and the
    four ``O^T`` chunks (not normalized)."""
    gl.static_assert(STEP == 1 or TMA_BOX > 0, "warpgroups taking turns refill the ring by bulk copies")
    qn_smem, qp_smem, kc_ring, kp_ring, p_smem, max_smem = smem
    ld_keys: gl.constexpr = (gl.BlockedLayout([1, 16], [8, 4], [gl.num_warps(), 1], [1, 0]) if IS_FP8
                             else gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0]))
    mma_s: gl.constexpr = _scores_layout(BLOCK_R, IS_FP8)
    mma_o: gl.constexpr = _out_layout(BLOCK_R, FP8_PV)
    cols_s: gl.constexpr = gl.SliceLayout(0, mma_s)  # per query row (a column of S^T)
    cols_o: gl.constexpr = gl.SliceLayout(0, mma_o)
    pv_ty: gl.constexpr = p_smem.dtype
    p_op = p_smem.permute([1, 0]) if FP8_PV else p_smem  # an fp8 wgmma operand in shared memory is K-major

    # Column (query row) visibility: causal bound, or tree mask bits.
    row_s = pid_g * BLOCK_R + gl.arange(0, BLOCK_R, layout=cols_s)
    tok_j = row_s // NUM_HEADS
    if TREE_MASK:
        mask_bits = gl.load(tree_mask_ptr + q_start + tok_j, mask=row_s < q_len * NUM_HEADS, other=0)
    else:
        visible = draft_start + 1 + tok_j

    m_i = gl.full([BLOCK_R], float("-inf"), gl.float32, layout=cols_s)
    l_tile = gl.zeros([BLOCK_N, BLOCK_R], gl.float32, layout=mma_s)
    acc0 = gl.zeros([V_CHUNK, BLOCK_R], gl.float32, layout=mma_o)
    acc1 = gl.zeros([V_CHUNK, BLOCK_R], gl.float32, layout=mma_o)
    acc2 = gl.zeros([V_CHUNK, BLOCK_R], gl.float32, layout=mma_o)
    acc3 = gl.zeros([V_CHUNK, BLOCK_R], gl.float32, layout=mma_o)
    v_ops: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_o, k_width=4 if FP8_PV else 2)
    v_words: gl.constexpr = _v_words(BLOCK_N)
    s_zero = gl.zeros([BLOCK_N, BLOCK_R], gl.float32, layout=mma_s)
    offs_key = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma_s))
    n_tiles = gl.cdiv(gl.maximum(end - start, 0), BLOCK_N)
    for i in range(FIRST, n_tiles, STEP):
        if TMA_BOX:  # the refill of this warpgroup's previous slot waits for the column-max barrier below
            _wait_tile_tma(kc_ring, bars, i, start, end, BLOCK_N, D_LATENT, NUM_BUFS)
        else:
            page = _advance_ring(kc_ring, kp_ring, i, page, start, end, cache_ptr, bt_row, stride_cache_block,
                                 stride_cache_tok, PAGE_SIZE, BLOCK_N, D_LATENT, D_ROPE, NUM_BUFS, ld_keys)
        kc = kc_ring.index(i % NUM_BUFS)
        kp = kp_ring.index(i % NUM_BUFS)

        s = warpgroup_mma(kc, qn_smem.permute([1, 0]), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma(kp, qp_smem.permute([1, 0]), s, is_async=True)
        s, _, _, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=[s, qn_smem, qp_smem, kc, kp])

        offs_n = start + i * BLOCK_N + offs_key
        if TREE_MASK:
            draft_k = offs_n - draft_start
            in_tree = ((mask_bits[None, :] >> gl.maximum(draft_k, 0)[:, None].to(gl.int64)) & 1) != 0
            seen = (offs_n < end)[:, None] & ((draft_k < 0)[:, None] | in_tree)
        elif PREFIX_ONLY:
            seen = (offs_n < end)[:, None]
        else:
            seen = (offs_n < end)[:, None] & (offs_n[:, None] < visible[None, :])
        s = gl.where(seen, s * score_scale, float("-inf"))
        m_new = gl.maximum(m_i, _column_max(s, max_smem, BLOCK_N, BLOCK_R, mma_s))
        if FP8_PV:  # a whole shift: P's fp8 rounding is then that of P relative to the final shift
            m_new = gl.ceil(m_new)
        if TMA_BOX:
            page = _refill_tma(kc_desc, kp_desc, kc_ring, kp_ring, bars, i, page, start, end, bt_row, PAGE_SIZE,
                               BLOCK_N, D_LATENT, NUM_BUFS, TMA_BOX, STEP)
        m_shift = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_shift)
        p = gl.exp2(s - m_shift[None, :])
        l_tile = l_tile * alpha[None, :] + p
        m_i = m_new

        if FP8_PV:
            p_smem.store(gl.permute((p * P_SCALE).to(pv_ty), [1, 0]))
        else:
            p_smem.store(p.to(pv_ty))
        fence_async_shared()
        gl.thread_barrier()  # all of P^T is written before the warpgroup reads it
        alpha_o = gl.convert_layout(alpha, cols_o)[None, :]
        acc0, v0 = _pv(kc, 0, p_op, acc0 * alpha_o, IS_FP8, FP8_PV, v_ops, v_words)
        acc1, v1 = _pv(kc, 1, p_op, acc1 * alpha_o, IS_FP8, FP8_PV, v_ops, v_words)
        if FP8_PV and BLOCK_R == 32:  # two chunks in flight here too: four spill (56 B, sm_90a on 2026-12-03)
            acc0 = warpgroup_mma_wait(num_outstanding=1, deps=[acc0])
            acc2, v2 = _pv(kc, 2, p_op, acc2 * alpha_o, IS_FP8, FP8_PV, v_ops, v_words)
            acc1 = warpgroup_mma_wait(num_outstanding=1, deps=[acc1])
            acc3, v3 = _pv(kc, 3, p_op, acc3 * alpha_o, IS_FP8, FP8_PV, v_ops, v_words)
            acc2, acc3, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=[acc2, acc3, p_smem, kc])
        elif FP8_PV:  # 8-bit operands cannot be wait dependencies; ptxas keeps their registers until the wait
            acc2, v2 = _pv(kc, 2, p_op, acc2 * alpha_o, IS_FP8, FP8_PV, v_ops, v_words)
            acc3, v3 = _pv(kc, 3, p_op, acc3 * alpha_o, IS_FP8, FP8_PV, v_ops, v_words)
            acc0, acc1, acc2, acc3, _, _ = warpgroup_mma_wait(num_outstanding=0,
                                                              deps=[acc0, acc1, acc2, acc3, p_smem, kc])
        elif IS_FP8 and BLOCK_R == 32:  # two V^T chunks in flight: four do not fit the registers at 32 rows
            acc0, v0 = warpgroup_mma_wait(num_outstanding=1, deps=[acc0, v0])
            acc2, v2 = _pv(kc, 2, p_op, acc2 * alpha_o, IS_FP8, FP8_PV, v_ops, v_words)
            acc1, v1 = warpgroup_mma_wait(num_outstanding=1, deps=[acc1, v1])
            acc3, v3 = _pv(kc, 3, p_op, acc3 * alpha_o, IS_FP8, FP8_PV, v_ops, v_words)
            acc2, acc3, _, _, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=[acc2, acc3, p_smem, kc, v2, v3])
        else:
            acc2, v2 = _pv(kc, 2, p_op, acc2 * alpha_o, IS_FP8, FP8_PV, v_ops, v_words)
            acc3, v3 = _pv(kc, 3, p_op, acc3 * alpha_o, IS_FP8, FP8_PV, v_ops, v_words)
            acc0, acc1, acc2, acc3, _, _, _, _, _, _ = warpgroup_mma_wait(
                num_outstanding=0, deps=[acc0, acc1, acc2, acc3, p_smem, kc, v0, v1, v2, v3])
    if not TMA_BOX:
        async_copy.wait_group(0)
    return m_i, l_tile, acc0, acc1, acc2, acc3


@gluon.jit
def _store_result(m_i, l_i, acc0, acc1, acc2, acc3, kv_scale, out_ptr, lse_ptr, pid_g, pid_s, q_start, q_len,
                  stride_out_t, stride_out_h, stride_out_s, stride_lse_t, stride_lse_h, NUM_HEADS: gl.constexpr,
                  BLOCK_R: gl.constexpr, DIRECT_OUT: gl.constexpr, IS_FP8: gl.constexpr, FP8_PV: gl.constexpr):
    """The normalized output and the log-sum-exp of ``_tiles``' result: the request's rows, or the
    split's partial (``DIRECT_OUT`` false)."""
    mma_o: gl.constexpr = _out_layout(BLOCK_R, FP8_PV)
    cols_o: gl.constexpr = gl.SliceLayout(0, mma_o)
    cols_s: gl.constexpr = gl.SliceLayout(0, _scores_layout(BLOCK_R, IS_FP8))
    has_keys = l_i > 0.0
    safe_l = gl.where(has_keys, l_i, 1.0)
    lse = gl.where(has_keys, (m_i + gl.log2(safe_l)) * 0.6931471805599453, float("-inf"))  # ln 2
    out_scale = gl.convert_layout(kv_scale / (safe_l * P_SCALE if FP8_PV else safe_l), cols_o)[None, :]

    row_o = pid_g * BLOCK_R + gl.arange(0, BLOCK_R, layout=gl.SliceLayout(0, _store_layout(BLOCK_R)))
    out_rows = (q_start + row_o // NUM_HEADS) * stride_out_t + (row_o % NUM_HEADS) * stride_out_h
    out_ok = row_o < q_len * NUM_HEADS
    if not DIRECT_OUT:
        out_rows += pid_s * stride_out_s
    _store_out(acc0 * out_scale, 0, out_ptr, out_rows, out_ok, FP8_PV)
    _store_out(acc1 * out_scale, 1, out_ptr, out_rows, out_ok, FP8_PV)
    _store_out(acc2 * out_scale, 2, out_ptr, out_rows, out_ok, FP8_PV)
    _store_out(acc3 * out_scale, 3, out_ptr, out_rows, out_ok, FP8_PV)
    row_s = pid_g * BLOCK_R + gl.arange(0, BLOCK_R, layout=cols_s)
    lse_ptrs = lse_ptr + (q_start + row_s // NUM_HEADS) * stride_lse_t + (row_s % NUM_HEADS) * stride_lse_h
    if not DIRECT_OUT:
        lse_ptrs += pid_s
    gl.store(lse_ptrs, lse, mask=row_s < q_len * NUM_HEADS)


@gluon.jit
def _merge_partner(m_i, l_i, acc0, acc1, acc2, acc3, vecs, parts, BLOCK_R: gl.constexpr, FP8_PV: gl.constexpr):
    """This warpgroup's softmax state merged with the one its partner left in shared memory (``vecs``:
    its maximum and row sums; ``parts``: its four ``O^T`` chunks). Both maxima are whole numbers under
    ``FP8_PV``, so the rescaling is exact and keeps ``P``'s rounding."""
    cols_s: gl.constexpr = gl.SliceLayout(0, _scores_layout(BLOCK_R, True))
    mma_o: gl.constexpr = _out_layout(BLOCK_R, FP8_PV)
    cols_o: gl.constexpr = gl.SliceLayout(0, mma_o)
    m_other = vecs.index(0).load(cols_s)
    m_new = gl.maximum(m_i, m_other)
    m_shift = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_shift)
    beta = gl.exp2(m_other - m_shift)
    l_new = l_i * alpha + vecs.index(1).load(cols_s) * beta
    alpha_o = gl.convert_layout(alpha, cols_o)[None, :]
    beta_o = gl.convert_layout(beta, cols_o)[None, :]
    acc0 = acc0 * alpha_o + parts.index(0).load(mma_o) * beta_o
    acc1 = acc1 * alpha_o + parts.index(1).load(mma_o) * beta_o
    acc2 = acc2 * alpha_o + parts.index(2).load(mma_o) * beta_o
    acc3 = acc3 * alpha_o + parts.index(3).load(mma_o) * beta_o
    return m_new, l_new, acc0, acc1, acc2, acc3


@gluon.jit
def _consumer(state, WG: gl.constexpr, NUM_HEADS: gl.constexpr, PAGE_SIZE: gl.constexpr, BLOCK_R: gl.constexpr,
              BLOCK_N: gl.constexpr, D_LATENT: gl.constexpr, D_ROPE: gl.constexpr, NUM_BUFS: gl.constexpr,
              TMA_BOX: gl.constexpr, FP8_PV: gl.constexpr, TREE_MASK: gl.constexpr, PREFIX_ONLY: gl.constexpr,
              DIRECT_OUT: gl.constexpr):
    """Warpgroup ``WG`` of a paired program (``CONSUMERS = 2``): every other tile of the split from
    the shared ring, then warpgroup 1 hands its softmax state over through the idle ring and warpgroup
    0 merges and stores. ``state``: the kernel's tuple of shared buffers, descriptors and scalars.

    Only one warpgroup at a time runs code after its loop: Triton 3.6 gives the barriers of a
    cross-warp reduction or layout change after the loop the id that the other partition's loop
    uses for its own (PTX of this kernel, 2026-12-03), so a warpgroup done early would release the
    other's column-max barrier with its own warps' arrivals."""
    (qn_smem, qp_smem, kc_ring, kp_ring, p_bufs, max_bufs, bars, sscale_smem, vecs, kc_desc, kp_desc, cache_ptr,
     bt_row, tree_mask_ptr, out_ptr, lse_ptr, kv_scale, pid_g, pid_s, q_start, q_len, draft_start, start, end,
     stride_out_t, stride_out_h, stride_out_s, stride_lse_t, stride_lse_h) = state
    cols_s: gl.constexpr = gl.SliceLayout(0, _scores_layout(BLOCK_R, True))
    score_scale = sscale_smem.load(cols_s)[None, :]
    page = _page_of(bt_row, start + (NUM_BUFS - 2 + WG) * BLOCK_N, end, PAGE_SIZE)  # this warpgroup's first refill
    smem = (qn_smem, qp_smem, kc_ring, kp_ring, p_bufs.index(WG), max_bufs.index(WG))
    m_i, l_tile, acc0, acc1, acc2, acc3 = _tiles(
        smem, bars, kc_desc, kp_desc, cache_ptr, bt_row, 0, 0, tree_mask_ptr, pid_g, q_start, q_len, draft_start, start,
        end, page, score_scale, WG, 2, NUM_HEADS, PAGE_SIZE, BLOCK_R, BLOCK_N, D_LATENT, D_ROPE, NUM_BUFS, TMA_BOX,
        True, FP8_PV, TREE_MASK, PREFIX_ONLY)
    _named_barrier(SYNC_RING_DONE)  # both loops are done; the ring is idle: every tile landed and was read
    parts = kc_ring._reinterpret(gl.float32, [4, V_CHUNK, BLOCK_R],
                                 gl.NVMMASharedLayout.get_default_for([V_CHUNK, BLOCK_R], gl.float32))
    if WG == 1:
        vecs.index(0).store(m_i)
        vecs.index(1).store(gl.sum(l_tile, axis=0))
        parts.index(0).store(acc0)
        parts.index(1).store(acc1)
        parts.index(2).store(acc2)
        parts.index(3).store(acc3)
        _named_barrier(ARRIVE_HANDED_OVER)
    else:
        _named_barrier(SYNC_HANDED_OVER)  # warpgroup 1 is done
        l_i = gl.sum(l_tile, axis=0)
        m_i, l_i, acc0, acc1, acc2, acc3 = _merge_partner(m_i, l_i, acc0, acc1, acc2, acc3, vecs, parts, BLOCK_R,
                                                          FP8_PV)
        _store_result(m_i, l_i, acc0, acc1, acc2, acc3, kv_scale, out_ptr, lse_ptr, pid_g, pid_s, q_start, q_len,
                      stride_out_t, stride_out_h, stride_out_s, stride_lse_t, stride_lse_h, NUM_HEADS, BLOCK_R,
                      DIRECT_OUT, True, FP8_PV)


@gluon.jit
def mla_decode_split_kernel_sm90_narrow(
    q_nope_ptr, q_pe_ptr, cache_ptr, block_table_ptr, seq_lens_ptr, kv_scale_ptr, tree_mask_ptr, q_start_ptr,
    out_ptr, lse_ptr, qk_scale_log2, uniform_q_len,
    stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h, stride_cache_block, stride_cache_tok, stride_bt_b,
    stride_out_t, stride_out_h, stride_out_s, stride_lse_t, stride_lse_h,
    NUM_HEADS: gl.constexpr, D_LATENT: gl.constexpr, D_ROPE: gl.constexpr, PAGE_SIZE: gl.constexpr,
    BLOCK_R: gl.constexpr, BLOCK_N: gl.constexpr, IS_FP8: gl.constexpr, FP8_QUERIES: gl.constexpr,
    DIRECT_OUT: gl.constexpr, TREE_MASK: gl.constexpr, VARLEN: gl.constexpr, PREFIX_ONLY: gl.constexpr,
    KEYS_DENSE: gl.constexpr, NUM_BUFS: gl.constexpr, kc_desc=None, kp_desc=None, TMA_BOX: gl.constexpr = 0,
    FP8_PV: gl.constexpr = False, CONSUMERS: gl.constexpr = 1,
):
    gl.static_assert(IS_FP8 == FP8_QUERIES and not KEYS_DENSE, "paged caches; fp8 ones with fp8 queries")
    gl.static_assert((BLOCK_R == 16 or BLOCK_R == 32) and PAGE_SIZE % BLOCK_N == 0 and NUM_BUFS >= 2)
    gl.static_assert(gl.num_warps() == 4, "one warpgroup (a second one: CONSUMERS = 2)")
    if CONSUMERS != 1:
        gl.static_assert(CONSUMERS == 2 and IS_FP8 and TMA_BOX > 0 and NUM_BUFS >= 3,
                         "two consumers: fp8 caches by bulk copies, three slots or more")
    dtype: gl.constexpr = q_nope_ptr.dtype.element_ty
    key_ty: gl.constexpr = cache_ptr.dtype.element_ty
    qk_ty: gl.constexpr = gl.float8e4nv if IS_FP8 else dtype
    gl.static_assert(not FP8_PV or IS_FP8, "fp8 P V: fp8 caches")
    pv_ty: gl.constexpr = key_ty if FP8_PV else (gl.float16 if IS_FP8 else dtype)  # P in the cache's format
    ld_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
    ld_keys: gl.constexpr = (gl.BlockedLayout([1, 16], [8, 4], [gl.num_warps(), 1], [1, 0]) if IS_FP8
                             else ld_layout)

    pid_g, pid_s, pid_b, q_start, q_len, draft_start, start, end = _program_split(
        q_start_ptr, seq_lens_ptr, uniform_q_len, BLOCK_N, VARLEN, PREFIX_ONLY)

    q_nope, q_pe, q_scale = _load_queries(q_nope_ptr, q_pe_ptr, q_start, q_len, pid_g, stride_qn_t, stride_qn_h,
                                          stride_qp_t, stride_qp_h, NUM_HEADS, D_LATENT, D_ROPE, BLOCK_R, IS_FP8,
                                          ld_layout)
    if IS_FP8:
        kv_scale = gl.load(kv_scale_ptr)
        score_scale = qk_scale_log2 * kv_scale / q_scale
    else:
        kv_scale = 1.0
        score_scale = qk_scale_log2
    qn_smem = gl.allocate_shared_memory(qk_ty, [BLOCK_R, D_LATENT],
                                        gl.NVMMASharedLayout.get_default_for([BLOCK_R, D_LATENT], qk_ty), q_nope)
    qp_smem = gl.allocate_shared_memory(qk_ty, [BLOCK_R, D_ROPE],
                                        gl.NVMMASharedLayout.get_default_for([BLOCK_R, D_ROPE], qk_ty), q_pe)
    kc_ring = gl.allocate_shared_memory(key_ty, [NUM_BUFS, BLOCK_N, D_LATENT],
                                        gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_LATENT], key_ty))
    kp_ring = gl.allocate_shared_memory(key_ty, [NUM_BUFS, BLOCK_N, D_ROPE],
                                        gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_ROPE], key_ty))
    p_shape: gl.constexpr = [BLOCK_R, BLOCK_N] if FP8_PV else [BLOCK_N, BLOCK_R]  # fp8: P, read as P^T
    p_bufs = gl.allocate_shared_memory(pv_ty, [CONSUMERS] + p_shape,
                                       gl.NVMMASharedLayout.get_default_for(p_shape, pv_ty))
    max_bufs = gl.allocate_shared_memory(gl.float32, [CONSUMERS, 4, BLOCK_R],
                                         gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))

    bt_row = block_table_ptr + pid_b * stride_bt_b
    if TMA_BOX:
        bars = gl.allocate_shared_memory(gl.int64, [NUM_BUFS, 1], mbarrier.MBarrierLayout())
        page = _start_ring_tma(kc_desc, kp_desc, kc_ring, kp_ring, bars, start, end, bt_row, PAGE_SIZE, BLOCK_N,
                               D_LATENT, NUM_BUFS, TMA_BOX, CONSUMERS)
    else:
        bars = None  # cp.async groups instead
        page = _start_ring(kc_ring, kp_ring, start, end, cache_ptr, bt_row, stride_cache_block, stride_cache_tok,
                           PAGE_SIZE, BLOCK_N, D_LATENT, D_ROPE, NUM_BUFS, ld_keys)

    if CONSUMERS == 2:
        vec: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        sscale_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_R], vec, score_scale)
        vecs = gl.allocate_shared_memory(gl.float32, [2, BLOCK_R], vec)
        state = (qn_smem, qp_smem, kc_ring, kp_ring, p_bufs, max_bufs, bars, sscale_smem, vecs, kc_desc, kp_desc,
                 cache_ptr, bt_row, tree_mask_ptr, out_ptr, lse_ptr, kv_scale, pid_g, pid_s, q_start, q_len,
                 draft_start, start, end, stride_out_t, stride_out_h, stride_out_s, stride_lse_t, stride_lse_h)
        gl.warp_specialize([
            (_consumer, (state, 0, NUM_HEADS, PAGE_SIZE, BLOCK_R, BLOCK_N, D_LATENT, D_ROPE, NUM_BUFS, TMA_BOX, FP8_PV,
                         TREE_MASK, PREFIX_ONLY, DIRECT_OUT)),
            (_consumer, (state, 1, NUM_HEADS, PAGE_SIZE, BLOCK_R, BLOCK_N, D_LATENT, D_ROPE, NUM_BUFS, TMA_BOX, FP8_PV,
                         TREE_MASK, PREFIX_ONLY, DIRECT_OUT)),
        ], [4], [_PAIRED_REGS])
    else:
        cols_s: gl.constexpr = gl.SliceLayout(0, _scores_layout(BLOCK_R, IS_FP8))
        if IS_FP8:
            score_scale = gl.convert_layout(score_scale, cols_s)[None, :]
        smem = (qn_smem, qp_smem, kc_ring, kp_ring, p_bufs.index(0), max_bufs.index(0))
        m_i, l_tile, acc0, acc1, acc2, acc3 = _tiles(
            smem, bars, kc_desc, kp_desc, cache_ptr, bt_row, stride_cache_block, stride_cache_tok, tree_mask_ptr, pid_g,
            q_start, q_len, draft_start, start, end, page, score_scale, 0, 1, NUM_HEADS, PAGE_SIZE, BLOCK_R, BLOCK_N,
            D_LATENT, D_ROPE, NUM_BUFS, TMA_BOX, IS_FP8, FP8_PV, TREE_MASK, PREFIX_ONLY)
        _store_result(m_i, gl.sum(l_tile, axis=0), acc0, acc1, acc2, acc3, kv_scale, out_ptr, lse_ptr, pid_g, pid_s,
                      q_start, q_len, stride_out_t, stride_out_h, stride_out_s, stride_lse_t, stride_lse_h, NUM_HEADS,
                      BLOCK_R, DIRECT_OUT, IS_FP8, FP8_PV)
