"""The fused MoE's first (gate/up) GEMM for Hopper (sm_90), warp-specialized, with the intermediate's
quantization in its epilogue.

Same contract as ``moe._moe_gemm_kernel`` with ``GATED`` and ``QUANT_OUT`` (the ``moe`` module
docstring has the formula), over A rows already in sorted order (``quantize_to_sorted_rows``): for
sorted row ``r`` of a run of expert ``e`` and intermediate column ``c``::

    h[r, c] = silu(g) * u,   g = sum_kb s_a[r, kb] s_w[e, c, kb] A[r, kb] W13[e, c, kb]^T,
                             u = the same over row I + c of W13[e]

rounded to ``MID_DTYPE`` and quantized per row and 128 columns as ``quantize_per_token_group``
quantizes (``quant.scale_of``, ``quantize_by_scale``): E4M3 values and fp32 scales.
Padding rows of a run are stored as zeros whatever A holds there (its padding rows are never
written), and only real rows are counted by the guard.

Structure (``gemm_sm90_ws``'s, with ``gemm_sm90``'s pairing of two K blocks in flight):

- persistent programs (``gemm_sm90_ws.grid``); a tile is 64 sorted rows (one expert's: runs are 64
  or 128 rows) by 128 intermediate columns, one quantization group;
- one producer warp copies each K block of the tile's A rows (``[64, 128]``) and of the expert's
  gate and up rows (two ``[128, 128]`` boxes of ``W13`` viewed as ``[E * 2I, H]``) by TMA into a
  ring of ``NUM_STAGES`` slots, on into the next tile;
- consumer warpgroup ``WG`` takes the tile's columns ``64 WG ..`` of gate and of up: two wgmma of
  ``64 x 64 x 128`` a K block into fp32 partials, folded with their own weight block's scale, two K
  blocks in flight (four partials, two accumulators: the registers of ``gemm_sm90_ws`` at 128 x 128);
- the epilogue: each consumer's row maxima over its 64 columns go through shared memory (two
  buffers by tile parity, an mbarrier of two arrivals) so both scale each row by the maximum of its
  128 columns; then the E4M3 values and (consumer 0) the scales are stored from registers.

Weights: ``I % 128 == 0`` (a tile's gate and up columns each lie in one weight block), 16-byte
aligned rows for the TMA copies (``H % 16 == 0``). Compiled for sm_90a (``benchmarks/hopper_compile.py``):
168 registers a thread at launch, no spills, wgmma not serialized, 206 KiB of shared memory at five
stages. On the H200 (``tests/gpu/test_moe_sm90_ws.py``): the Triton kernel's bytes with fixed seeds;
at DeepSeek-V3's 4096 tokens 4.15 ms against DeepGEMM's 3.53 for this GEMM alone
(``benchmarks/results/fp8-moe-ws-2026-12-05.md``).
"""

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .gemm_sm90 import _fold, grouped_tile
from .gemm_sm90_ws import (
    BARRIER_BYTES,
    CONSUMER_REGS,
    NUM_WARPS,
    PRODUCER_REGS,
    SHARED_BYTES,
    _hand_back,
    box_descriptor,
    claim_slot,
    ring_barriers,
)
from .quant import add_nonfinite, max_nan, quantize_by_scale, scale_of

ROWS = gl.constexpr(64)  # sorted rows a tile: both consumers take all of them
BLOCK_N = gl.constexpr(128)  # intermediate columns a tile: one quantization group, 64 a consumer
BLOCK_K = gl.constexpr(128)  # one scale block


@triton.jit
def silu_gate(gate, up):
    """``silu(gate) * up`` in fp32: the gated product both MoE gate/up kernels compute."""
    return gate * tl.sigmoid(gate) * up


def fits(config: dict) -> bool:
    """Whether this kernel takes a gate/up launch (``"KERNEL": "sm90_ws"``) over runs of ``config["BLOCK_M"]``,
    its ring within ``SHARED_BYTES`` (at most five stages)."""
    return (config["BLOCK_M"] % ROWS.value == 0 and config["num_warps"] == NUM_WARPS.value
            and config["num_stages"] >= 2 and config.get("BLOCK_N", BLOCK_N.value) == BLOCK_N.value
            and shared_bytes(config["num_stages"]) <= SHARED_BYTES)


def shared_bytes(num_stages: int) -> int:
    """Shared memory of a launch: the ring's A, gate and up boxes, and the row maxima's exchange buffers."""
    return num_stages * (ROWS.value + 2 * BLOCK_N.value) * BLOCK_K.value + 4 * ROWS.value * 4 + BARRIER_BYTES


def descriptors(a: torch.Tensor, w13: torch.Tensor) -> tuple[TensorDescriptor, TensorDescriptor]:
    """TMA descriptors of the sorted A rows ``[P, H]`` and of ``W13 [E, 2I, H]`` as ``[E * 2I, H]``."""
    experts, two_i, hidden = w13.shape
    return box_descriptor(a, ROWS.value), box_descriptor(w13.view(experts * two_i, hidden), BLOCK_N.value)


@gluon.jit
def _num_tiles(M, inter):
    return gl.cdiv(M, ROWS) * gl.cdiv(inter, BLOCK_N)


@gluon.jit
def _expert(block_expert_ptr, pid_m, RUN_ROWS: gl.constexpr):
    """The expert of the tile's 64 rows: their run's."""
    return gl.load(block_expert_ptr + pid_m * ROWS // RUN_ROWS)


@gluon.jit
def _producer(a_desc, w_desc, a_ring, g_ring, u_ring, ready, empty, M, inter, k_blocks, block_expert_ptr,
              RUN_ROWS: gl.constexpr, GROUP_M: gl.constexpr, NUM_STAGES: gl.constexpr):
    """Copy every K block of this program's tiles' A rows, gate rows and up rows into the ring."""
    nbytes: gl.constexpr = a_desc.block_type.nbytes + 2 * w_desc.block_type.nbytes
    it = 0
    for tile in range(gl.program_id(0), _num_tiles(M, inter), gl.num_programs(0)):
        pid_m, pid_n = grouped_tile(tile, M, inter, ROWS, BLOCK_N, GROUP_M)
        gate_row = _expert(block_expert_ptr, pid_m, RUN_ROWS) * 2 * inter + pid_n * BLOCK_N
        for kb in range(k_blocks):
            slot = claim_slot(ready, empty, it, nbytes, NUM_STAGES)
            tma.async_copy_global_to_shared(a_desc, [pid_m * ROWS, kb * BLOCK_K], ready.index(slot),
                                            a_ring.index(slot))
            tma.async_copy_global_to_shared(w_desc, [gate_row, kb * BLOCK_K], ready.index(slot), g_ring.index(slot))
            tma.async_copy_global_to_shared(w_desc, [gate_row + inter, kb * BLOCK_K], ready.index(slot),
                                            u_ring.index(slot))
            it += 1


@gluon.jit
def _issue(a_ring, g_ring, u_ring, ready, it, gate, up, WG: gl.constexpr, NUM_STAGES: gl.constexpr):
    """Once the ring's K block ``it`` has landed, start its two wgmma over this warpgroup's 64 gate
    and 64 up columns into ``gate`` and ``up`` (overwritten)."""
    slot = it % NUM_STAGES
    mbarrier.wait(ready.index(slot), it // NUM_STAGES & 1)
    a = a_ring.index(slot)
    gate = warpgroup_mma(a, g_ring.index(slot).slice(WG * 64, 64, dim=0).permute([1, 0]), gate, use_acc=False,
                         is_async=True)
    up = warpgroup_mma(a, u_ring.index(slot).slice(WG * 64, 64, dim=0).permute([1, 0]), up, use_acc=False,
                       is_async=True)
    return gate, up


@gluon.jit
def _row_scales(a_scales, gate_scale, up_scale, kb):
    """``s_a[rows, kb]`` times the gate block's and the up block's weight scale of K block ``kb``."""
    a_s = gl.load(a_scales + kb)
    return a_s * gl.load(gate_scale + kb), a_s * gl.load(up_scale + kb)


@gluon.jit
def _gate_up_products(ring, ready, empty, scales, expert, pid_m, pid_n, inter, k_blocks, it, mma: gl.constexpr,
                      WG: gl.constexpr, NUM_STAGES: gl.constexpr):
    """``(gate, up)``: columns ``64 WG ..`` of tile ``(pid_m, pid_n)`` of both products, whose first K
    block is the ring's block ``it``, each K block's partial folded with its scales. Two K blocks in
    flight, as in ``gemm_sm90`` (K blocks in pairs, each register set's next wgmma writing over its
    folded partial, the folds volatile): a K block's folds run under the next one's wgmma."""
    a_ring, g_ring, u_ring = ring
    a_scale_ptr, stride_asm, w_scale_ptr, stride_wse, stride_wsn = scales
    rows = pid_m * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, mma))
    a_scales = a_scale_ptr + rows.to(gl.int64) * stride_asm
    w_scales = w_scale_ptr + expert.to(gl.int64) * stride_wse
    gate_scale = w_scales + pid_n * stride_wsn
    up_scale = w_scales + (inter // BLOCK_K + pid_n) * stride_wsn
    zeros = gl.zeros([ROWS, 64], gl.float32, layout=mma)
    acc_g = zeros
    acc_u = zeros
    odd_g = zeros
    odd_u = zeros
    even_g, even_u = _issue(a_ring, g_ring, u_ring, ready, it, zeros, zeros, WG, NUM_STAGES)
    scale_g, scale_u = _row_scales(a_scales, gate_scale, up_scale, 0)
    for pair in range((k_blocks - 1) // 2):
        kb = 2 * pair + 1
        odd_g, odd_u = _issue(a_ring, g_ring, u_ring, ready, it + kb, odd_g, odd_u, WG, NUM_STAGES)
        even_g, even_u = warpgroup_mma_wait(num_outstanding=2, deps=[even_g, even_u])
        _hand_back(empty, it + kb - 1, NUM_STAGES)
        acc_g = _fold(acc_g, even_g, scale_g)
        acc_u = _fold(acc_u, even_u, scale_u)
        scale_g, scale_u = _row_scales(a_scales, gate_scale, up_scale, kb)
        even_g, even_u = _issue(a_ring, g_ring, u_ring, ready, it + kb + 1, even_g, even_u, WG, NUM_STAGES)
        odd_g, odd_u = warpgroup_mma_wait(num_outstanding=2, deps=[odd_g, odd_u])
        _hand_back(empty, it + kb, NUM_STAGES)
        acc_g = _fold(acc_g, odd_g, scale_g)
        acc_u = _fold(acc_u, odd_u, scale_u)
        scale_g, scale_u = _row_scales(a_scales, gate_scale, up_scale, kb + 1)
    if k_blocks % 2 == 0:  # one K block left
        last_g, last_u = _issue(a_ring, g_ring, u_ring, ready, it + k_blocks - 1, odd_g, odd_u, WG, NUM_STAGES)
        done_g, done_u = warpgroup_mma_wait(num_outstanding=2, deps=[even_g, even_u])
        _hand_back(empty, it + k_blocks - 2, NUM_STAGES)
        acc_g = _fold(acc_g, done_g, scale_g)
        acc_u = _fold(acc_u, done_u, scale_u)
        scale_g, scale_u = _row_scales(a_scales, gate_scale, up_scale, k_blocks - 1)
        done_g, done_u = warpgroup_mma_wait(num_outstanding=0, deps=[last_g, last_u])
        _hand_back(empty, it + k_blocks - 1, NUM_STAGES)
        acc_g = _fold(acc_g, done_g, scale_g)
        acc_u = _fold(acc_u, done_u, scale_u)
    else:
        done_g, done_u = warpgroup_mma_wait(num_outstanding=0, deps=[even_g, even_u])
        _hand_back(empty, it + k_blocks - 1, NUM_STAGES)
        acc_g = _fold(acc_g, done_g, scale_g)
        acc_u = _fold(acc_u, done_u, scale_u)
    return acc_g, acc_u


@gluon.jit
def _store_quantized(gate, up, exchange, out, sorted_ids_ptr, num_pairs, pid_m, pid_n, inter, t, mma: gl.constexpr,
                     WG: gl.constexpr, QUANT: gl.constexpr):
    """``silu(gate) * up`` of this consumer's 64 columns of the program's ``t``-th tile, as
    ``MID_DTYPE`` holds it (padding rows zero, whatever A held there), quantized with each row's
    maximum over the tile's 128 columns: the other consumer's 64 come through ``exchange``."""
    h_ptr, stride_hm, h_scale_ptr, stride_hsm, stats_ptr, eps = out
    amax_bufs, amax_ready = exchange
    MID_DTYPE: gl.constexpr = QUANT[0]
    FP8_MAX: gl.constexpr = QUANT[1]
    rows = pid_m * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, mma))
    cols = pid_n * BLOCK_N + WG * 64 + gl.arange(0, 64, layout=gl.SliceLayout(0, mma))
    real = gl.load(sorted_ids_ptr + rows) < num_pairs
    h = gl.where(real[:, None], silu_gate(gate, up), 0.0).to(MID_DTYPE).to(gl.float32)
    amax = gl.reduce(gl.abs(h), 1, max_nan)  # NaN kept, as quant.group_amax
    amax_bufs.index(t % 2 * 2 + WG).store(amax)
    gl.thread_barrier()
    mbarrier.arrive(amax_ready, count=1)
    mbarrier.wait(amax_ready, t & 1)
    other = amax_bufs.index(t % 2 * 2 + 1 - WG).load(gl.SliceLayout(1, mma))
    scale = scale_of(max_nan(amax, other), eps, FP8_MAX, False)
    y = quantize_by_scale(h, scale[:, None], FP8_MAX)
    mask_cols = (cols < inter)[None, :]
    gl.store(h_ptr + rows.to(gl.int64)[:, None] * stride_hm + cols[None, :], y.to(h_ptr.dtype.element_ty),
             mask=mask_cols)
    if WG == 0:
        gl.store(h_scale_ptr + rows.to(gl.int64) * stride_hsm + pid_n, scale)
    if QUANT[2]:  # the guard's non-finite count, real rows only
        add_nonfinite(stats_ptr, h, real[:, None] & mask_cols)


@gluon.jit
def _consumer(ring, ready, empty, exchange, scales, out, sorted_ids_ptr, block_expert_ptr, M, num_pairs, inter,
              k_blocks, WG: gl.constexpr, RUN_ROWS: gl.constexpr, GROUP_M: gl.constexpr, NUM_STAGES: gl.constexpr,
              QUANT: gl.constexpr):
    """Consumer warpgroup ``WG``: its 64 gate and up columns of each of this program's tiles.
    ``QUANT``: ``(MID_DTYPE, FP8_MAX, TRACK_STATS)``."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 32])
    it = 0
    t = 0
    for tile in range(gl.program_id(0), _num_tiles(M, inter), gl.num_programs(0)):
        pid_m, pid_n = grouped_tile(tile, M, inter, ROWS, BLOCK_N, GROUP_M)
        gate, up = _gate_up_products(ring, ready, empty, scales, _expert(block_expert_ptr, pid_m, RUN_ROWS), pid_m,
                                     pid_n, inter, k_blocks, it, mma, WG, NUM_STAGES)
        _store_quantized(gate, up, exchange, out, sorted_ids_ptr, num_pairs, pid_m, pid_n, inter, t, mma, WG, QUANT)
        it += k_blocks
        t += 1


@gluon.jit
def moe_gate_up_kernel_sm90_ws(
    a_desc, w_desc, a_scale_ptr, w_scale_ptr, h_ptr, h_scale_ptr, stats_ptr, rows_in_use_ptr, sorted_ids_ptr,
    block_expert_ptr, num_pairs, inter, K, stride_asm, stride_wse, stride_wsn, stride_hm, stride_hsm, eps,
    RUN_ROWS: gl.constexpr, GROUP_M: gl.constexpr, NUM_STAGES: gl.constexpr, MID_DTYPE: gl.constexpr,
    FP8_MAX: gl.constexpr, TRACK_STATS: gl.constexpr,
):
    """Persistent: program ``p`` of ``P`` takes the tiles ``p, p + P, ...`` of the ``rows_in_use[0]``
    sorted rows by ``inter`` columns (``grouped_tile`` order). ``a_desc``: ``[64, 128]`` boxes over the
    sorted A rows; ``w_desc``: ``[128, 128]`` boxes over ``W13`` as ``[E * 2I, H]`` (``descriptors``).
    ``w_scale``: ``[E, 2I / 128, cdiv(H, 128)]``; ``h`` ``[P, inter]`` fp8 and ``h_scale`` ``[P, inter / 128]``."""
    gl.static_assert(gl.num_warps() == NUM_WARPS and NUM_STAGES >= 2 and RUN_ROWS % ROWS == 0)
    k_blocks = gl.cdiv(K, BLOCK_K)
    M = gl.load(rows_in_use_ptr)

    a_ring = gl.allocate_shared_memory(a_desc.dtype, [NUM_STAGES, ROWS, BLOCK_K], a_desc.layout)
    g_ring = gl.allocate_shared_memory(w_desc.dtype, [NUM_STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
    u_ring = gl.allocate_shared_memory(w_desc.dtype, [NUM_STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
    ready, empty = ring_barriers(NUM_STAGES)
    # each consumer's row maxima (buffer 2 * tile parity + consumer)
    amax_bufs = gl.allocate_shared_memory(gl.float32, [4, ROWS], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    amax_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(amax_ready, count=2)
    fence_async_shared()

    ring = (a_ring, g_ring, u_ring)
    exchange = (amax_bufs, amax_ready)
    scales = (a_scale_ptr, stride_asm, w_scale_ptr, stride_wse, stride_wsn)
    out = (h_ptr, stride_hm, h_scale_ptr, stride_hsm, stats_ptr, eps)
    QUANT: gl.constexpr = (MID_DTYPE, FP8_MAX, TRACK_STATS)
    gl.warp_specialize([
        (_consumer, (ring, ready, empty, exchange, scales, out, sorted_ids_ptr, block_expert_ptr, M, num_pairs,
                     inter, k_blocks, 0, RUN_ROWS, GROUP_M, NUM_STAGES, QUANT)),
        (_consumer, (ring, ready, empty, exchange, scales, out, sorted_ids_ptr, block_expert_ptr, M, num_pairs,
                     inter, k_blocks, 1, RUN_ROWS, GROUP_M, NUM_STAGES, QUANT)),
        (_producer, (a_desc, w_desc, a_ring, g_ring, u_ring, ready, empty, M, inter, k_blocks, block_expert_ptr,
                     RUN_ROWS, GROUP_M, NUM_STAGES)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])

