"""The MLA decode split kernel for Hopper (sm_90), in Gluon: 64-row groups, with the two
warpgroups in different phases (the schedule FlashMLA calls "seesaw").

Same contract, arguments and partial outputs as ``decode._mla_decode_split_kernel`` (the module
docstring of ``decode`` has the formula), for the launches it takes: ``BLOCK_R = 64`` rows, a
paged cache with pages a multiple of 64 tokens (bf16/fp16, or fp8 with E4M3 queries as
``DecodePlan.fp8_queries`` sets for 64-row groups, and ``P`` rounded to the cache's format as
``DecodePlan.fp8_probs`` sets; no dense keys), ``D_latent = 512``, ``D_rope = 64``.
``decode.mla_decode`` sends those launches here on an sm_90 GPU with ``launch_options``, and keeps
the Triton kernel for the rest, for the interpreter and as the fallback
(``LATENTSPEED_MLA_DECODE_SM90=0``).

Why this schedule: with both warpgroups on every phase of a tile together (scores, softmax,
``P V``; the kernel this one replaced), the tensor cores idle while both run the softmax. Here
``gl.warp_specialize`` gives each warpgroup its own instruction stream (warpgroup 0 is the default
partition, warpgroup 1 a 4-warp worker), and the tiles go in pairs: even tile ``b`` in buffer 0,
odd tile ``b + 1`` in buffer 1.

- Warpgroup 0 computes the whole score tile ``S0 = Q K_b^T`` (wgmma, queries and keys in shared
  memory) and owns output columns 0-255; warpgroup 1 computes ``S1 = Q K_{b+1}^T`` and owns
  columns 256-511. Each holds ``[64, 256]`` fp32 of the output.
- One running row maximum lives in shared memory; each warpgroup's softmax publishes its rescale
  factor beside it. Per pair:

      wg0: softmax(S0) -> scale0 | O_L = O_L*scale0 + P0 V0_L | wait scale1 | P0*scale1 -> smem
           | refill buffer 0 columns 0-255 | wait P1 | O_L = O_L*scale1 + P1 V1_L
           | issue S0' = Q K_{b+2}^T | (P1 V1_L done) refill buffer 1 columns 0-255
      wg1: wait scale0 | softmax(S1) -> scale1 | P1 -> smem, signal P1 | O_R = O_R*scale0*scale1 + P1 V1_R
           | wait P0 | O_R += P0 V0_R | refill buffers 1 and 0 columns 256-575 | S1' = Q K_{b+3}^T

  While one warpgroup runs its softmax, the other's wgmma keep the tensor cores busy. The
  handshakes are named barriers over both warpgroups (``bar.arrive`` / ``bar.sync``).
- Each warpgroup refills the part of a buffer that only it reads last, so a buffer needs no
  "free" signal; "full" is an mbarrier on which every thread's ``cp.async`` copies arrive (256
  arrivals). Rows past the split's end are zero-filled; a pair past the last tile computes on
  those zeros, fully masked.
- A tile below the split's end and below every row's first invisible key skips the mask.
- fp8 caches: the scores are one fp8 wgmma over E4M3 queries (rounded as the Triton kernel rounds
  them, ``sm90_common._load_queries``) and the fp8 keys as they are in shared memory, scaled back
  per row. ``P V`` runs in fp8 too (``FP8_PV``, ``DecodePlan.fp8_probs``), as in
  ``decode_sm90_narrow``: the maximum rounded up to a whole number, ``P`` times ``P_SCALE`` rounded to
  the cache's format and written to shared memory (warpgroup 0 its own copy besides ``P0``), and
  each warpgroup's output transposed, ``O^T = V^T P^T`` in two accumulators of ``V_CHUNK`` latent
  rows, with ``V^T`` loaded from the tile into registers four latent bytes a word
  (``sm90_common._pv``: fp8 wgmma reads only K-major operands from shared memory, and a tile's
  latent part is K-major for ``Q K^T``, not for ``P V``). A row's rescale factors then run along the
  accumulators' columns, read back from shared memory in that layout. With
  ``LATENTSPEED_MLA_DECODE_FP8_PV=0`` (or ``USE_FP8_PV = 0``) ``P`` stays fp16 and each warpgroup
  widens its 256 columns of a tile's latent part to fp16 (exact) into a buffer of its own instead:
  warpgroup 0 one buffer, used twice a pair; warpgroup 1 two, the second widened while its first
  ``P V`` runs.

- With fp8 ``P V`` the tiles go through two pairs of buffers (``RING_PAIRS``, ``FP8_PV_RING_PAIRS``):
  pair ``j`` in buffers ``2 (j % 2)`` and ``2 (j % 2) + 1``, refilled with pair ``j + 2``, so that each copy
  is issued a whole pair before its scores instead of half a pair (Nsight Compute put 26 % of the
  widened fp8 kernel's stall samples on waiting for a tile at 4k, ``benchmarks/notes.md``).

Shared memory: bf16/fp16 caches, queries 72 KiB, two 64-token tiles 144 KiB, ``P0`` 8 KiB: 225.5
KiB with the row vectors and barriers (``P1`` reuses the queries' RoPE part, which each warpgroup
first loads into registers, wgmma's A operand from registers). fp8 caches: queries 36 KiB, four
tiles 144 KiB, three fp8 ``P`` buffers 12 KiB: 193.8 KiB; widened, two tiles 72 KiB, ``P0`` and ``P1``
16 KiB and three widened halves 96 KiB: 221.8 KiB. ptxas for sm_90a: 240 registers, no spills over
16-bit caches; fp8 ``P V`` 248 registers (``FP8_PV_MAXNREG``; 108 bytes of spills at 240), no spills;
widened, 240 and 36 bytes of spills (``python -m benchmarks.hopper_compile decode --heads 128``).

Measured on the H200 (``benchmarks/results/mla_decode-sm90-seesaw-2026-12-02.md``): over bf16 caches
1.07-1.12x faster than the kernel it replaced and 1.09-1.25x FLASHMLA's time at batch 128,
128 heads; over fp8 caches 1.07-1.13x faster than the kernel it replaced.
Over fp8 caches with fp8 ``P V`` and two pairs of buffers, on an H100 at batch 128
(``benchmarks/results/mla_decode-h128-fp8pv-h100-2026-12-05-s35.md``, both orders): 1.26-1.43x faster than the
widened kernel (two pairs against one: 1.02-1.24x), for 1.7e-2 (E4M3) and 3.5e-2 (E5M2) more relative error;
1.39-1.59x faster than this kernel over a bf16 cache and 1.04-1.09x FLASHMLA's fp8 time in the same process; on the
H200 (``benchmarks/results/mla_decode-h128-h200-2026-12-06-s37.md``) 1.39-1.54x and 1.05-1.10x. Then warpgroup 1
signalled ``P1`` as soon as it was stored, not after issuing ``P0 V0_R``: 1.05x faster over fp8 caches in both
orders, bf16 unchanged (H100, ``benchmarks/results/mla_decode-h128-early-p1-ab-h100-2026-12-06-s38.md``).
"""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ..fp8_format import FP8_DTYPES
from .cache import HALF_DTYPES
from .sm90_common import (
    D_LATENT,
    D_ROPE,
    P_SCALE,
    V_CHUNK,
    _load_queries,
    _named_barrier,
    _page_of,
    _program_split,
    _pv,
    _store_out,
    _v_words,
    fp8_pv_allowed,
)

BLOCK_R = 64
BLOCK_N = 64
NUM_WARPS = 4  # warpgroup 0; warpgroup 1 is a worker partition of 4 more
MAXNREG = 240  # registers a thread, both warpgroups (no spills at 240; the launch's cap)
FP8_PV_MAXNREG = 248  # with USE_FP8_PV: no spills at 248 (108 B at 240; sm_90a, ptxas of CUDA 13)
_WORKER_REGS = gl.constexpr(MAXNREG)
_FP8_PV_WORKER_REGS = gl.constexpr(FP8_PV_MAXNREG)
_DEFAULT_WARPS = gl.constexpr(NUM_WARPS)
HALF = gl.constexpr(D_LATENT // 2)  # output columns a warpgroup owns
USE_FP8_PV = 1  # fp8 caches: P V in fp8, V^T from registers (module docstring)
FP8_PV_RING_PAIRS = 2  # with it, two pairs of tile buffers (room without the widened V): copies a pair ahead
# fp8 P V is planned where every split reads at least this many tokens or the launch has programs for more than half
# the multiprocessors (``fp8_pv_pays``).
# H100, E4M3, 128 heads, batches 1-16, against the widened fp16 P V: 0.90-0.99x at 16-64 programs and 64-128 tokens a
# split, 1.02x at 64 programs of 256 tokens and 1.13-1.14x of 512; 0.99-1.04x at 128 programs and 64-128 tokens a split,
# 1.04-1.52x from 256 (benchmarks/results/mla_decode-fp8-pv-rule-sweep-h100-2026-12-07-s53.md). H200, 64 heads (E4M3,
# E5M2) and 128 heads (E5M2), at most 64 programs: 0.96-0.98x at 128 tokens a split, 1.00-1.02x at 192, 1.01-1.17x
# from 256 (mla_decode-fp8-pv-rule-sweep-h200-2026-12-07-s54.md). Not the ring's depth: one pair loses there as well.
# H100, 64 and 128 heads, both fp8 caches, 32-64 programs: 0.98-1.01x at 136-144 tokens a split, 1.00-1.02x at
# 160-188 (mla_decode-fp8-pv-ncu-and-rule-h100-2026-12-07-s56.md).
MIN_TOKENS_PER_FP8_PV_SPLIT = 160

# Named barriers over both warpgroups (256 threads); Triton's own use ids 0, 1 and 2 + worker index.
SYNC_SCALE0 = gl.constexpr("bar.sync 8, 256; mov.u32 $0, 0;")
ARRIVE_SCALE0 = gl.constexpr("bar.arrive 8, 256; mov.u32 $0, 0;")
SYNC_SCALE1 = gl.constexpr("bar.sync 9, 256; mov.u32 $0, 0;")
ARRIVE_SCALE1 = gl.constexpr("bar.arrive 9, 256; mov.u32 $0, 0;")
SYNC_P0 = gl.constexpr("bar.sync 10, 256; mov.u32 $0, 0;")
ARRIVE_P0 = gl.constexpr("bar.arrive 10, 256; mov.u32 $0, 0;")
SYNC_P1 = gl.constexpr("bar.sync 11, 256; mov.u32 $0, 0;")
ARRIVE_P1 = gl.constexpr("bar.arrive 11, 256; mov.u32 $0, 0;")
SYNC_END = gl.constexpr("bar.sync 12, 256; mov.u32 $0, 0;")


def fp8_pv(cache_dtype: torch.dtype) -> bool:
    """Whether this kernel runs ``P V`` in fp8 over a cache of that dtype (``USE_FP8_PV``, and
    ``sm90_common.fp8_pv_allowed``): ``P`` as in ``decode_sm90_narrow.fp8_pv``."""
    return bool(USE_FP8_PV) and fp8_pv_allowed(cache_dtype)


def fp8_pv_pays(tokens_per_split: int, programs: int, num_sms: int) -> bool:
    """Whether a plan of ``programs`` launches of this kernel, each split reading ``tokens_per_split``
    tokens, runs ``P V`` in fp8 where ``fp8_pv`` allows it (``MIN_TOKENS_PER_FP8_PV_SPLIT``)."""
    return tokens_per_split >= MIN_TOKENS_PER_FP8_PV_SPLIT or 2 * programs > num_sms


def launch_options(fp8_probs: bool) -> dict:
    """The kernel's launch options beyond the common arguments: the warps, the register cap,
    ``FP8_PV`` (``DecodePlan.fp8_probs``) and with it ``FP8_PV_RING_PAIRS`` pairs of tile buffers."""
    return dict(num_warps=NUM_WARPS, maxnreg=FP8_PV_MAXNREG if fp8_probs else MAXNREG, FP8_PV=fp8_probs,
                RING_PAIRS=FP8_PV_RING_PAIRS if fp8_probs else 1)


def fits(block_rows: int, keys_dtype: torch.dtype, paged: bool, page_size: int, d_latent: int, d_rope: int) -> bool:
    """Whether this kernel takes a launch of that shape (on an sm_90 GPU)."""
    return (block_rows == BLOCK_R and keys_dtype in (*HALF_DTYPES, *FP8_DTYPES) and paged
            and page_size % BLOCK_N == 0 and (d_latent, d_rope) == (D_LATENT, D_ROPE))


@gluon.jit
def _opaque_zero():
    """0, unknown to the compiler: shared-memory views indexed by it are rebuilt where they are used,
    so their wgmma descriptors are not computed once and kept live (spilled) across the loop."""
    return gl.inline_asm_elementwise("mov.u32 $0, 0;", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _copy_part(kc, kp, bar, n0, end, cache_ptr, page, stride_cache_block, stride_cache_tok, WG: gl.constexpr,
               PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, D_LATENT: gl.constexpr, D_ROPE: gl.constexpr):
    """Warpgroup ``WG``'s part of cache tokens ``[n0, n0 + BLOCK_N)`` below ``end`` into one buffer
    (wg0: latent columns 0-255; wg1: 256-511 and the RoPE part); each thread arrives on ``bar``
    when its copies have landed. Rows past ``end`` are zero-filled, nothing read for them."""
    if kc.dtype.primitive_bitwidth == 8:
        ld: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [gl.num_warps(), 1], [1, 0])
    else:
        ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
    offs_tok = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld))
    rows = cache_ptr + page * stride_cache_block + (offs_tok % PAGE_SIZE)[:, None].to(gl.int64) * stride_cache_tok
    in_range = (offs_tok < end)[:, None]
    offs_c = gl.arange(0, HALF, layout=gl.SliceLayout(0, ld))
    if WG == 0:
        async_copy.async_copy_global_to_shared(kc.slice(0, HALF, dim=1), rows + offs_c[None, :], mask=in_range)
    else:
        async_copy.async_copy_global_to_shared(kc.slice(HALF, HALF, dim=1), rows + HALF + offs_c[None, :],
                                               mask=in_range)
        offs_p = gl.arange(0, D_ROPE, layout=gl.SliceLayout(0, ld))
        async_copy.async_copy_global_to_shared(kp, rows + D_LATENT + offs_p[None, :], mask=in_range)
    async_copy.mbarrier_arrive(bar, increment_count=False)


@gluon.jit
def _widen(src, dst):
    """An fp8 ``[64, 256]`` latent half from a tile into ``dst`` in fp16 (exact), 64 columns a step;
    the partition's stores are visible to its wgmma afterwards."""
    ld: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [gl.num_warps(), 1], [1, 0])
    for c in gl.static_range(HALF // 64):
        v = src.slice(c * 64, 64, dim=1).load(ld)
        dst.slice(c * 64, 64, dim=1).store(v.to(dst.dtype))
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _scores(qn_smem, q_pe, kc, kp, bar, phase, BLOCK_N: gl.constexpr, mma_s: gl.constexpr):
    """Issue ``Q K^T`` for the tile in (kc, kp) once it has landed (not waited for)."""
    mbarrier.wait(bar, phase)
    s = warpgroup_mma(qn_smem, kc.permute([1, 0]), gl.zeros([64, BLOCK_N], gl.float32, layout=mma_s),
                      use_acc=False, is_async=True)
    return warpgroup_mma(q_pe, kp.permute([1, 0]), s, is_async=True)


@gluon.jit
def _masked(s, t, start, end, draft_start, row_s, mask_bits, NUM_HEADS: gl.constexpr, BLOCK_N: gl.constexpr,
            TREE_MASK: gl.constexpr, PREFIX_ONLY: gl.constexpr, mma_s: gl.constexpr):
    """Scores of tile ``t`` (already in base-2 units) with invisible keys at -inf; a tile below
    ``end`` and below every row's first invisible key (the draft tokens' causal or tree bound)
    needs no mask."""
    n0 = start + t * BLOCK_N
    if PREFIX_ONLY:
        bound = end
    elif TREE_MASK:
        bound = gl.minimum(end, draft_start)
    else:
        bound = gl.minimum(end, draft_start + 1)
    if n0 + BLOCK_N > bound:
        s = _mask(s, n0, end, draft_start, row_s, mask_bits, NUM_HEADS, BLOCK_N, TREE_MASK, PREFIX_ONLY, mma_s)
    return s


@gluon.jit
def _mask(s, n0, end, draft_start, row_s, mask_bits, NUM_HEADS: gl.constexpr, BLOCK_N: gl.constexpr,
          TREE_MASK: gl.constexpr, PREFIX_ONLY: gl.constexpr, mma_s: gl.constexpr):
    """The mask itself: keys past ``end``, or past a row's causal bound, or outside its tree."""
    offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma_s))
    if TREE_MASK:
        draft_k = offs_n - draft_start
        in_tree = ((mask_bits[:, None] >> gl.maximum(draft_k, 0)[None, :].to(gl.int64)) & 1) != 0
        seen = (offs_n < end)[None, :] & ((draft_k < 0)[None, :] | in_tree)
    elif PREFIX_ONLY:
        seen = (offs_n < end)[None, :]
    else:
        visible = draft_start + 1 + row_s // NUM_HEADS
        seen = (offs_n < end)[None, :] & (offs_n[None, :] < visible[:, None])
    return gl.where(seen, s, float("-inf"))


@gluon.jit
def _pv_half(tile, WG: gl.constexpr, p_op, acc, acc_hi, FP8_PV: gl.constexpr, v_ops: gl.constexpr,
             v_words: gl.constexpr):
    """Start this warpgroup's ``P V`` over its half of the latent columns of ``tile``: ``FP8_PV``,
    ``O^T += V^T P^T`` in two ``V_CHUNK`` accumulators (``acc``, ``acc_hi``; ``V^T`` from registers,
    ``_pv``), ``p_op`` being ``P^T`` in shared memory; else ``O += P V`` in one (``tile`` the widened
    or 16-bit half, ``acc_hi`` passed through)."""
    if FP8_PV:
        acc, _ = _pv(tile, 2 * WG, p_op, acc, True, True, v_ops, v_words)
        acc_hi, _ = _pv(tile, 2 * WG + 1, p_op, acc_hi, True, True, v_ops, v_words)
    else:
        acc = warpgroup_mma(p_op, tile, acc, is_async=True)
    return acc, acc_hi


@gluon.jit
def _rescaled(acc, acc_hi, factor, FP8_PV: gl.constexpr, o_rows: gl.constexpr):
    """The output accumulators times a factor per query row: ``factor`` along the columns of ``O^T``
    (``FP8_PV``), else along the rows of ``O`` (``o_rows``)."""
    if FP8_PV:
        acc = acc * factor[None, :]
        acc_hi = acc_hi * factor[None, :]
    else:
        acc = acc * gl.convert_layout(factor, o_rows)[:, None]
    return acc, acc_hi


@gluon.jit
def _warpgroup(state, WG: gl.constexpr, IS_FP8: gl.constexpr, FP8_PV: gl.constexpr, NUM_HEADS: gl.constexpr,
               D_LATENT: gl.constexpr, D_ROPE: gl.constexpr, PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr,
               DIRECT_OUT: gl.constexpr, TREE_MASK: gl.constexpr, PREFIX_ONLY: gl.constexpr,
               RING_PAIRS: gl.constexpr):
    """Warpgroup ``WG``'s side of the schedule (module docstring); ``state`` is the kernel's tuple
    of shared buffers, pointers and scalars (a tuple, so that the constexprs passed beside it stay
    constexprs through ``warp_specialize``)."""
    (qn_ring, qp_smem, kc_ring, kp_ring, p0_smem, m_smem, scale_smem, l_smem, full_bars, cache_ptr, block_table_ptr,
     tree_mask_ptr, out_ptr, lse_ptr, qk_scale_log2, pid_g, pid_s, pid_b, q_start, q_len, draft_start, start, end,
     stride_cache_block, stride_cache_tok, stride_bt_b, stride_out_t, stride_out_h, stride_out_s, stride_lse_t,
     stride_lse_h, fp8_state) = state
    (p1_buf, sscale_smem, v_bufs, kv_scale_ptr, p_own) = fp8_state
    dtype: gl.constexpr = p0_smem.dtype  # P V's operands: the cache's 16-bit type, fp16 over fp8 caches, or fp8
    mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                    instr_shape=[16, BLOCK_N, 32 if IS_FP8 else 16])
    if FP8_PV:  # O^T: [V_CHUNK latent, 64 rows] a chunk, two chunks a warpgroup; a row's factors along the columns
        mma_o: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 32])
        o_rows: gl.constexpr = gl.SliceLayout(0, mma_o)
        acc_shape: gl.constexpr = [V_CHUNK, 64]
    else:  # O: [64 rows, HALF latent]
        mma_o: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HALF, 16])
        o_rows: gl.constexpr = gl.SliceLayout(1, mma_o)
        acc_shape: gl.constexpr = [64, HALF]
    rows_s: gl.constexpr = gl.SliceLayout(1, mma_s)
    p_operand: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_o, k_width=2)
    v_ops: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_o, k_width=4)
    v_words: gl.constexpr = _v_words(BLOCK_N)

    row_s = pid_g * 64 + gl.arange(0, 64, layout=rows_s)
    if TREE_MASK:
        mask_bits = gl.load(tree_mask_ptr + q_start + row_s // NUM_HEADS, mask=row_s < q_len * NUM_HEADS, other=0)
    else:
        mask_bits = row_s  # not read without a tree
    bt_row = block_table_ptr + pid_b * stride_bt_b
    qn_smem = qn_ring.index(0)
    kc0 = kc_ring.index(0)
    kp0 = kp_ring.index(0)
    kc1 = kc_ring.index(1)
    kp1 = kp_ring.index(1)
    bar0 = full_bars.index(0)
    bar1 = full_bars.index(1)
    if IS_FP8:  # scores scaled per row (query scale, kv scale); V widened into fp16 buffers, or P V in fp8
        q_pe = qp_smem
        p1_smem = p1_buf
        score_scale = sscale_smem.load(rows_s)[:, None]
        kv_scale = gl.load(kv_scale_ptr)
    else:  # Q's RoPE part into registers: its shared memory becomes P1 once both warpgroups hold it.
        q_pe = qp_smem.load(gl.DotOperandLayout(operand_index=0, parent=mma_s, k_width=2))
        p1_smem = qp_smem
        score_scale = qk_scale_log2
        kv_scale = 1.0
    p_scale = P_SCALE if FP8_PV else 1.0  # P's fp8 rounding happens at [0, P_SCALE]

    for t in gl.static_range(2 * RING_PAIRS):  # the first pairs' tiles, one buffer each
        _copy_part(kc_ring.index(t), kp_ring.index(t), full_bars.index(t), start + t * BLOCK_N, end, cache_ptr,
                   _page_of(bt_row, start + t * BLOCK_N, end, PAGE_SIZE), stride_cache_block, stride_cache_tok, WG,
                   PAGE_SIZE, BLOCK_N, D_LATENT, D_ROPE)
    if WG == 0:
        s = _scores(qn_smem, q_pe, kc0, kp0, bar0, 0, BLOCK_N, mma_s)
    else:
        s = _scores(qn_smem, q_pe, kc1, kp1, bar1, 0, BLOCK_N, mma_s)
    s, _, _, _, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=[s, qn_smem, kc0, kc1, kp0, kp1])

    acc = gl.zeros(acc_shape, gl.float32, layout=mma_o)
    acc_hi = gl.zeros([V_CHUNK, 64] if FP8_PV else [64], gl.float32,
                      layout=mma_o if FP8_PV else rows_s)  # the second chunk of O^T; unused without FP8_PV
    l_i = gl.zeros([64], gl.float32, layout=rows_s)
    n_tiles = gl.cdiv(gl.maximum(end - start, 0), BLOCK_N)
    for j in range(gl.cdiv(n_tiles, 2)):
        b = 2 * j
        z = _opaque_zero()
        base = 2 * (j % RING_PAIRS)  # this pair's two buffers
        ahead = 2 * RING_PAIRS  # the refills take tiles b + ahead and b + ahead + 1, into the same buffers
        qn_smem = qn_ring.index(z)
        kc0 = kc_ring.index(z + base)
        kp0 = kp_ring.index(z + base)
        kc1 = kc_ring.index(z + base + 1)
        kp1 = kp_ring.index(z + base + 1)
        bar0 = full_bars.index(base)
        bar1 = full_bars.index(base + 1)
        nbase = 2 * ((j + 1) % RING_PAIRS)  # the next pair's, whose scores this iteration issues
        if FP8_PV:  # _pv_half reads this warpgroup's latent chunks of the whole tile
            v_own = kc0 if WG == 0 else kc1
            v_other = kc1 if WG == 0 else kc0
        elif WG == 0:
            v_own = kc0.slice(0, HALF, dim=1)
            v_other = kc1.slice(0, HALF, dim=1)
        else:
            v_own = kc1.slice(HALF, HALF, dim=1)
            v_other = kc0.slice(HALF, HALF, dim=1)
        page_a = _page_of(bt_row, start + (b + ahead) * BLOCK_N, end, PAGE_SIZE)
        page_b = _page_of(bt_row, start + (b + ahead + 1) * BLOCK_N, end, PAGE_SIZE)
        phase = ((j + 1) // RING_PAIRS) & 1  # of the next pair's buffers: their fill count
        if WG == 0:
            m_old = m_smem.load(rows_s)
            s = _masked(s * score_scale, b, start, end, draft_start, row_s, mask_bits, NUM_HEADS, BLOCK_N,
                        TREE_MASK, PREFIX_ONLY, mma_s)
            m_new = gl.maximum(m_old, gl.max(s, axis=1))
            if FP8_PV:  # a whole shift: P's fp8 rounding is then that of P relative to the final shift
                m_new = gl.ceil(m_new)
            m_shift = gl.where(m_new == float("-inf"), 0.0, m_new)
            scale0 = gl.exp2(m_old - m_shift)
            p = gl.exp2(s - m_shift[:, None])
            l_i = l_i * scale0 + gl.sum(p, axis=1)
            m_smem.store(m_new)
            scale_smem[0].store(scale0)
            _named_barrier(ARRIVE_SCALE0)
            p = (p * p_scale).to(dtype)  # kept as the wgmma operand and, rescaled, for warpgroup 1
            if FP8_PV:  # P^T as wgmma's B operand from shared memory; the factor read back along O^T's columns
                p_own.store(p)
                fence_async_shared()
                gl.thread_barrier()
                acc, acc_hi = _rescaled(acc, acc_hi, scale_smem[0].load(o_rows), FP8_PV, o_rows)
                acc, acc_hi = _pv_half(v_own, WG, p_own.permute([1, 0]), acc, acc_hi, FP8_PV, v_ops, v_words)
                acc, acc_hi, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=[acc, acc_hi, p_own, v_own])
            else:
                if IS_FP8:
                    _widen(v_own, v_bufs[0])
                    v_own = v_bufs[0]
                acc, acc_hi = _rescaled(acc, acc_hi, scale0, FP8_PV, o_rows)
                acc, acc_hi = _pv_half(v_own, WG, gl.convert_layout(p, p_operand), acc, acc_hi, FP8_PV, v_ops,
                                       v_words)
                acc, _ = warpgroup_mma_wait(num_outstanding=0, deps=[acc, v_own])
            _named_barrier(SYNC_SCALE1)
            scale1 = scale_smem[1].load(rows_s)
            p0_smem.store((p.to(gl.float32) * scale1[:, None]).to(dtype))
            fence_async_shared()
            _named_barrier(ARRIVE_P0)
            _copy_part(kc0, kp0, bar0, start + (b + ahead) * BLOCK_N, end, cache_ptr, page_a, stride_cache_block,
                       stride_cache_tok, WG, PAGE_SIZE, BLOCK_N, D_LATENT, D_ROPE)
            if IS_FP8 and not FP8_PV:  # P0 V0_L is done: the buffer takes V1_L
                _widen(v_other, v_bufs[0])
                v_other = v_bufs[0]
            _named_barrier(SYNC_P1)
            l_i = l_i * scale1
            acc, acc_hi = _rescaled(acc, acc_hi, scale_smem[1].load(o_rows) if FP8_PV else scale1, FP8_PV, o_rows)
            acc, acc_hi = _pv_half(v_other, WG, p1_smem.permute([1, 0]) if FP8_PV else p1_smem, acc, acc_hi, FP8_PV,
                                   v_ops, v_words)
            kn = kc_ring.index(z + nbase)
            pn = kp_ring.index(z + nbase)
            s = _scores(qn_smem, q_pe, kn, pn, full_bars.index(nbase), phase, BLOCK_N, mma_s)
            if FP8_PV:  # the P V of both chunks, then the two score wgmma
                acc, acc_hi, _, _ = warpgroup_mma_wait(num_outstanding=2, deps=[acc, acc_hi, p1_smem, v_other])
            else:
                acc, _, _ = warpgroup_mma_wait(num_outstanding=2, deps=[acc, p1_smem, v_other])
            _copy_part(kc1, kp1, bar1, start + (b + ahead + 1) * BLOCK_N, end, cache_ptr, page_b, stride_cache_block,
                       stride_cache_tok, WG, PAGE_SIZE, BLOCK_N, D_LATENT, D_ROPE)
            s, _, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=[s, qn_smem, kn, pn])
        else:
            _named_barrier(SYNC_SCALE0)
            m_old = m_smem.load(rows_s)
            scale0 = scale_smem[0].load(rows_s)
            if FP8_PV:
                scale0_o = scale_smem[0].load(o_rows)
            s = _masked(s * score_scale, b + 1, start, end, draft_start, row_s, mask_bits, NUM_HEADS, BLOCK_N,
                        TREE_MASK, PREFIX_ONLY, mma_s)
            m_new = gl.maximum(m_old, gl.max(s, axis=1))
            if FP8_PV:
                m_new = gl.ceil(m_new)
            m_shift = gl.where(m_new == float("-inf"), 0.0, m_new)
            scale1 = gl.exp2(m_old - m_shift)
            p = gl.exp2(s - m_shift[:, None])
            l_i = l_i * (scale0 * scale1) + gl.sum(p, axis=1)
            m_smem.store(m_new)
            scale_smem[1].store(scale1)
            _named_barrier(ARRIVE_SCALE1)
            p_half = (p * p_scale).to(dtype)
            p1_smem.store(p_half)
            fence_async_shared()
            _named_barrier(ARRIVE_P1)
            if FP8_PV:  # this warpgroup's P1 and scale1 read back by all its threads
                gl.thread_barrier()
                acc, acc_hi = _rescaled(acc, acc_hi, scale0_o * scale_smem[1].load(o_rows), FP8_PV, o_rows)
                acc, acc_hi = _pv_half(v_own, WG, p1_smem.permute([1, 0]), acc, acc_hi, FP8_PV, v_ops, v_words)
            else:
                if IS_FP8:
                    _widen(v_own, v_bufs[1])
                    v_own = v_bufs[1]
                acc, acc_hi = _rescaled(acc, acc_hi, scale0 * scale1, FP8_PV, o_rows)
                acc, acc_hi = _pv_half(v_own, WG, gl.convert_layout(p_half, p_operand), acc, acc_hi, FP8_PV, v_ops,
                                       v_words)
                if IS_FP8:  # while P1 V1_R runs
                    _widen(v_other, v_bufs[2])
                    v_other = v_bufs[2]
            _named_barrier(SYNC_P0)
            acc, acc_hi = _pv_half(v_other, WG, p0_smem.permute([1, 0]) if FP8_PV else p0_smem, acc, acc_hi, FP8_PV,
                                   v_ops, v_words)
            if FP8_PV:  # two wgmma for each of P1 V1_R and P0 V0_R
                acc, acc_hi, _ = warpgroup_mma_wait(num_outstanding=2, deps=[acc, acc_hi, v_own])
            else:
                acc, _ = warpgroup_mma_wait(num_outstanding=1, deps=[acc, v_own])
            _copy_part(kc1, kp1, bar1, start + (b + ahead + 1) * BLOCK_N, end, cache_ptr, page_b, stride_cache_block,
                       stride_cache_tok, WG, PAGE_SIZE, BLOCK_N, D_LATENT, D_ROPE)
            if FP8_PV:
                acc, acc_hi, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=[acc, acc_hi, p0_smem, v_other])
            else:
                acc, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=[acc, p0_smem, v_other])
            _copy_part(kc0, kp0, bar0, start + (b + ahead) * BLOCK_N, end, cache_ptr, page_a, stride_cache_block,
                       stride_cache_tok, WG, PAGE_SIZE, BLOCK_N, D_LATENT, D_ROPE)
            kn = kc_ring.index(z + nbase + 1)
            pn = kp_ring.index(z + nbase + 1)
            s = _scores(qn_smem, q_pe, kn, pn, full_bars.index(nbase + 1), phase, BLOCK_N, mma_s)
            s, _, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=[s, qn_smem, kn, pn])

    if RING_PAIRS == 2:  # the copies of the pair after the last scores issued: nobody has waited for them
        last = gl.cdiv(n_tiles, 2) + 1
        mbarrier.wait(full_bars.index(2 * (last % 2)), (last // 2) & 1)
        mbarrier.wait(full_bars.index(2 * (last % 2) + 1), (last // 2) & 1)

    # Both warpgroups' row sums are relative to the final maximum: add them through shared memory.
    l_smem[WG].store(l_i)
    _named_barrier(SYNC_END)
    l_o = l_smem[0].load(o_rows) + l_smem[1].load(o_rows)  # the same order in both warpgroups
    safe_l = gl.where(l_o > 0.0, l_o, 1.0)
    row_o = pid_g * 64 + gl.arange(0, 64, layout=o_rows)
    out_rows = (q_start + row_o // NUM_HEADS) * stride_out_t + (row_o % NUM_HEADS) * stride_out_h
    if not DIRECT_OUT:
        out_rows += pid_s * stride_out_s
    out_ok = row_o < q_len * NUM_HEADS
    out_scale = kv_scale / (safe_l * p_scale)
    if FP8_PV:
        _store_out(acc * out_scale[None, :], 2 * WG, out_ptr, out_rows, out_ok, True)
        _store_out(acc_hi * out_scale[None, :], 2 * WG + 1, out_ptr, out_rows, out_ok, True)
    else:
        offs_co = WG * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, mma_o))
        gl.store(out_ptr + out_rows[:, None] + offs_co[None, :],
                 (acc * out_scale[:, None]).to(out_ptr.dtype.element_ty), mask=out_ok[:, None])
    if WG == 0:
        l_i = l_smem[0].load(rows_s) + l_smem[1].load(rows_s)
        has_keys = l_i > 0.0
        lse = gl.where(has_keys, (m_smem.load(rows_s) + gl.log2(gl.where(has_keys, l_i, 1.0))) * 0.6931471805599453,
                       float("-inf"))  # ln 2
        lse_ptrs = lse_ptr + (q_start + row_s // NUM_HEADS) * stride_lse_t + (row_s % NUM_HEADS) * stride_lse_h
        if not DIRECT_OUT:
            lse_ptrs += pid_s
        gl.store(lse_ptrs, lse, mask=row_s < q_len * NUM_HEADS)


@gluon.jit
def mla_decode_split_kernel_sm90_seesaw(
    q_nope_ptr, q_pe_ptr, cache_ptr, block_table_ptr, seq_lens_ptr, kv_scale_ptr, tree_mask_ptr, q_start_ptr,
    out_ptr, lse_ptr, qk_scale_log2, uniform_q_len,
    stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h, stride_cache_block, stride_cache_tok, stride_bt_b,
    stride_out_t, stride_out_h, stride_out_s, stride_lse_t, stride_lse_h,
    NUM_HEADS: gl.constexpr, D_LATENT: gl.constexpr, D_ROPE: gl.constexpr, PAGE_SIZE: gl.constexpr,
    BLOCK_R: gl.constexpr, BLOCK_N: gl.constexpr, IS_FP8: gl.constexpr, FP8_QUERIES: gl.constexpr,
    DIRECT_OUT: gl.constexpr, TREE_MASK: gl.constexpr, VARLEN: gl.constexpr, PREFIX_ONLY: gl.constexpr,
    KEYS_DENSE: gl.constexpr, FP8_PV: gl.constexpr = False, RING_PAIRS: gl.constexpr = 1,
):
    gl.static_assert(IS_FP8 == FP8_QUERIES and not KEYS_DENSE, "paged caches; fp8 ones with fp8 queries")
    gl.static_assert(not FP8_PV or IS_FP8, "fp8 P V: fp8 caches")
    gl.static_assert(RING_PAIRS == 1 or (RING_PAIRS == 2 and FP8_PV), "a second pair of buffers: fp8 P V (room)")
    gl.static_assert(BLOCK_R == 64 and BLOCK_N == 64 and PAGE_SIZE % BLOCK_N == 0)
    gl.static_assert(D_LATENT == 2 * HALF and D_ROPE == 64)
    gl.static_assert(gl.num_warps() == _DEFAULT_WARPS, "warpgroup 0 is the default partition")
    key_ty: gl.constexpr = cache_ptr.dtype.element_ty
    qk_ty: gl.constexpr = gl.float8e4nv if IS_FP8 else q_nope_ptr.dtype.element_ty
    dtype: gl.constexpr = key_ty if FP8_PV else (gl.float16 if IS_FP8 else q_nope_ptr.dtype.element_ty)  # P V's

    pid_g, pid_s, pid_b, q_start, q_len, draft_start, start, end = _program_split(
        q_start_ptr, seq_lens_ptr, uniform_q_len, BLOCK_N, VARLEN, PREFIX_ONLY)

    ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    q_nope, q_pe, q_scale = _load_queries(q_nope_ptr, q_pe_ptr, q_start, q_len, pid_g, stride_qn_t, stride_qn_h,
                                          stride_qp_t, stride_qp_h, NUM_HEADS, D_LATENT, D_ROPE, BLOCK_R, IS_FP8, ld)
    qn_ring = gl.allocate_shared_memory(qk_ty, [1, BLOCK_R, D_LATENT],
                                        gl.NVMMASharedLayout.get_default_for([BLOCK_R, D_LATENT], qk_ty))
    qn_ring.index(0).store(q_nope)
    qp_smem = gl.allocate_shared_memory(qk_ty, [BLOCK_R, D_ROPE],
                                        gl.NVMMASharedLayout.get_default_for([BLOCK_R, D_ROPE], qk_ty), q_pe)
    kc_ring = gl.allocate_shared_memory(key_ty, [2 * RING_PAIRS, BLOCK_N, D_LATENT],
                                        gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_LATENT], key_ty))
    kp_ring = gl.allocate_shared_memory(key_ty, [2 * RING_PAIRS, BLOCK_N, D_ROPE],
                                        gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_ROPE], key_ty))
    p0_smem = gl.allocate_shared_memory(dtype, [BLOCK_R, BLOCK_N],
                                        gl.NVMMASharedLayout.get_default_for([BLOCK_R, BLOCK_N], dtype))
    vec: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    m_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_R], vec,
                                       gl.full([BLOCK_R], float("-inf"), gl.float32, layout=gl.SliceLayout(1, ld)))
    # the two warpgroups' rescale factors and, at the end, their row sums
    scale_smem = (gl.allocate_shared_memory(gl.float32, [BLOCK_R], vec),
                  gl.allocate_shared_memory(gl.float32, [BLOCK_R], vec))
    l_smem = (gl.allocate_shared_memory(gl.float32, [BLOCK_R], vec),
              gl.allocate_shared_memory(gl.float32, [BLOCK_R], vec))
    if IS_FP8:
        kv_scale = gl.load(kv_scale_ptr)
        sscale_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_R], vec, qk_scale_log2 * kv_scale / q_scale)
        p1_buf = gl.allocate_shared_memory(dtype, [BLOCK_R, BLOCK_N],
                                           gl.NVMMASharedLayout.get_default_for([BLOCK_R, BLOCK_N], dtype))
    else:
        sscale_smem = m_smem
        p1_buf = p0_smem
    if FP8_PV:  # warpgroup 0's own P (V^T comes from registers: no widened buffers)
        p_own = gl.allocate_shared_memory(dtype, [BLOCK_R, BLOCK_N],
                                          gl.NVMMASharedLayout.get_default_for([BLOCK_R, BLOCK_N], dtype))
        v_bufs = (p0_smem, p0_smem, p0_smem)
    elif IS_FP8:
        p_own = p0_smem
        v_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HALF], dtype)
        v_bufs = (gl.allocate_shared_memory(dtype, [BLOCK_N, HALF], v_layout),
                  gl.allocate_shared_memory(dtype, [BLOCK_N, HALF], v_layout),
                  gl.allocate_shared_memory(dtype, [BLOCK_N, HALF], v_layout))
    else:
        p_own = p0_smem
        v_bufs = (p0_smem, p0_smem, p0_smem)
    full_bars = gl.allocate_shared_memory(gl.int64, [2 * RING_PAIRS, 1], mbarrier.MBarrierLayout())
    for t in gl.static_range(2 * RING_PAIRS):
        mbarrier.init(full_bars.index(t), count=256)
    fence_async_shared()

    state = (qn_ring, qp_smem, kc_ring, kp_ring, p0_smem, m_smem, scale_smem, l_smem, full_bars,
             cache_ptr, block_table_ptr, tree_mask_ptr, out_ptr, lse_ptr, qk_scale_log2,
             pid_g, pid_s, pid_b, q_start, q_len, draft_start, start, end, stride_cache_block, stride_cache_tok,
             stride_bt_b, stride_out_t, stride_out_h, stride_out_s, stride_lse_t, stride_lse_h,
             (p1_buf, sscale_smem, v_bufs, kv_scale_ptr, p_own))
    gl.warp_specialize([
        (_warpgroup, (state, 0, IS_FP8, FP8_PV, NUM_HEADS, D_LATENT, D_ROPE, PAGE_SIZE, BLOCK_N, DIRECT_OUT, TREE_MASK,
                      PREFIX_ONLY, RING_PAIRS)),
        (_warpgroup, (state, 1, IS_FP8, FP8_PV, NUM_HEADS, D_LATENT, D_ROPE, PAGE_SIZE, BLOCK_N, DIRECT_OUT, TREE_MASK,
                      PREFIX_ONLY, RING_PAIRS)),
    ], [4], [_FP8_PV_WORKER_REGS if FP8_PV else _WORKER_REGS])
