"""The block-scaled fp8 GEMM for Hopper (sm_90), warp-specialized: one warp copies, two warpgroups
multiply.

Same contract as ``gemm._block_scaled_gemm_kernel`` (the ``gemm`` module docstring has the formula):
``C [M, N] = sum_kb a_scale[:, kb] * b_scale[:, kb] * A[:, kb] B[:, kb]^T``, one fp32 partial per 128-wide
K block, scaled before it joins the fp32 accumulator; with ``SPLIT_K`` > 1 (not grouped) each split's fp32
partial ``[M, N]``, which ``gemm`` sums. A tuned table selects it per shape with ``"KERNEL": "sm90_ws"``.
Grouped by expert (``GROUPED``, the kernel's docstring) it is also the fused MoE's second GEMM
(``moe._grouped_gemm_sm90_ws``; on the H200 1.07-1.16x DeepGEMM's grouped GEMM,
``benchmarks/results/fp8-h200-2026-12-05.md``) and, with ``SEPARATE_ACT``, its first one's products. As the
second GEMM it stores the pairs' rows only: with runs of 128 rows, 32 pairs an expert (DeepSeek-V3 at 1024
tokens) stored 4x the output's bytes (466 MB against 118 MB under ncu on the H100); the MoE went from
4.63 to 4.53 ms there, and from 6.26 to 6.12 ms at 4096 tokens (``fp8-moe-padding-h100-2026-12-05.md``).

Why a third kernel: the Triton kernel and ``gemm_sm90`` stop at 620-760 TFLOP/s on the H200 where
DeepGEMM reaches 1200-1330 (``benchmarks/notes.md``). ncu put 20 % of the Triton kernel's stall
samples on the wait for each K block's wgmma, and both kernels copy with ``cp.async``, 16 bytes a
thread. This one has DeepGEMM's structure:

- persistent programs, one a multiprocessor (``grid``), each taking 128 x ``BLOCK_N`` tiles in turn;
  one producer warp copies each K block of A (128 rows) and B (``BLOCK_N`` rows) by TMA into a
  ring of ``NUM_STAGES`` slots (the copy engine zero-fills rows and K columns past the matrix),
  running on into the next tile while the consumers store the last one;
- two consumer warpgroups, 64 rows each, with two K blocks' wgmma in flight in two register sets
  (``gemm_sm90``'s pairing): each waits for the older one, hands its slot back and folds its
  partial into the accumulator with the K block's scales while the newer one runs;
- each consumer writes its 64 rows of C as bf16/fp16 into a shared buffer of its own and sends them
  by a bulk tensor store (TMA), waited for only before the buffer's next use, so that its next tile
  starts at once; where C's rows are not 16-byte aligned (``out_descriptor``), stores from registers;
- registers moved to the consumers (``setmaxnreg``): ``CONSUMER_REGS`` each, ``PRODUCER_REGS`` for
  the copy warp.

Barriers: ``ready[s]`` completes when slot ``s``'s bytes have landed (TMA transaction count);
``empty[s]`` when both consumers are done with it (count 2, one arrival a warpgroup after a
barrier of its four warps). The ring's first pass waits on nothing: a fresh barrier counts as
having completed the phase before its first.

Operands need 16-byte aligned rows (TMA): ``K % 16 == 0``. Compiled for sm_90a
(``benchmarks/hopper_compile.py``): 168 registers a thread at launch, no spills, wgmma not
serialized; 224 KiB of shared memory at 128 x 128 with six stages and bulk stores (192 without). On the
H200, M = 4096, as CUDA-graph replays in the tuner: 1187-1224 TFLOP/s at (N, K) = (7168, 16384) and
(4096, 7168). Against waiting for each K block, the two in flight made 128 x 128 tiles 1.02-1.20x faster
(``benchmarks/results/fp8-gemm-ws-pipelined-2026-12-04.md``); then persistence 1.32-1.62x at K = 512,
1.02-1.21x at K = 1536-2048, 1.00-1.06x at K >= 7168 (``fp8-gemm-ws-persistent-2026-12-04.md``); then the
bulk stores 1.57-1.99x at K = 512, 1.18-1.40x at K = 1536-2048, 0.99-1.13x at K >= 7168
(``fp8-gemm-ws-tma-store-2026-12-04.md``).
"""

import functools

import torch
import triton
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

from .gemm_sm90 import _fold, _row_scale, grouped_tile

BLOCK_M = gl.constexpr(128)  # two consumer warpgroups of 64 rows
BLOCK_K = gl.constexpr(128)  # one scale block
NUM_WARPS = gl.constexpr(4)  # the default partition: consumer 0; consumer 1 (4 warps) and the producer (1) are workers
CONSUMER_REGS = gl.constexpr(232)
PRODUCER_REGS = gl.constexpr(40)
# registers a thread at launch: the kernel's 4 + 4 + 1 warps count as three warpgroups, and the
# registers left by the workers' requests go to the default partition
MAXNREG = 168
BLOCK_NS = (128, 64)  # a tile's columns lie in one 128-wide weight block
SPLITS = (1, 2, 3, 4, 8, 16)  # K splits (fp32 partials summed by gemm._split_k_sum_kernel): few tiles at small M
SHARED_BYTES = 232448  # a block's shared memory on Hopper (227 KiB)
BARRIER_BYTES = 1024  # room for the mbarriers and alignment


def fits(config: dict) -> bool:
    """Whether this kernel takes a launch config (its ring and C buffers within ``SHARED_BYTES``)."""
    split = config.get("SPLIT_K", 1)
    return (split in SPLITS and config["BLOCK_M"] == BLOCK_M.value and config["BLOCK_N"] in BLOCK_NS
            and config["num_warps"] == NUM_WARPS.value and config["num_stages"] >= 2
            and shared_bytes(config["BLOCK_N"], config["num_stages"], split > 1) <= SHARED_BYTES)


def shared_bytes(block_n: int, num_stages: int, split_k: bool = False) -> int:
    """Shared memory of a launch: the ring's A and B boxes, and the consumers' two bf16/fp16 C buffers
    (none with ``split_k``: fp32 partials leave from registers)."""
    c_buffers = 0 if split_k else 2 * 64 * block_n * 2
    return num_stages * (BLOCK_M.value + block_n) * BLOCK_K.value + c_buffers + BARRIER_BYTES


def splits_fit(k: int, split_k: int) -> bool:
    """Whether ``split_k`` splits of K's 128-wide blocks leave every split at least one block."""
    return split_k <= triton.cdiv(k, BLOCK_K.value)


@functools.cache
def _box_layout(rows: int) -> gl.NVMMASharedLayout:
    """The shared layout of a ``[rows, BLOCK_K]`` fp8 box (built once: it costs host time every launch)."""
    return gl.NVMMASharedLayout.get_default_for([rows, BLOCK_K.value], gl.float8e4nv)


def box_descriptor(t: torch.Tensor, rows: int) -> TensorDescriptor:
    """A TMA descriptor of an fp8 matrix (16-byte aligned rows) in ``[rows, BLOCK_K]`` boxes."""
    return TensorDescriptor.from_tensor(t, [rows, BLOCK_K.value], _box_layout(rows))


def descriptors(a, b, block_n: int) -> tuple[TensorDescriptor, TensorDescriptor]:
    """TMA descriptors of A ``[M, K]`` and B ``[N, K]`` in the kernel's boxes."""
    return box_descriptor(a, BLOCK_M.value), box_descriptor(b, block_n)


@functools.cache
def _out_layout(block_n: int, dtype: torch.dtype) -> gl.NVMMASharedLayout:
    """The shared layout of a consumer's ``[64, block_n]`` box of C."""
    gl_dtype = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[dtype]
    return gl.NVMMASharedLayout.get_default_for([64, block_n], gl_dtype)


def out_descriptor(out, block_n: int) -> TensorDescriptor | None:
    """A TMA descriptor of C ``[M, N]`` in the consumers' ``[64, block_n]`` boxes, or ``None`` where C's
    rows are not 16-byte aligned (the kernel then stores from registers)."""
    if out.stride(1) != 1 or (out.stride(0) * out.element_size()) % 16 or out.data_ptr() % 16:
        return None
    return TensorDescriptor.from_tensor(out, [64, block_n], _out_layout(block_n, out.dtype))


@gluon.jit
def _producer(a_desc, b_desc, a_ring, b_ring, ready, empty, M, N, k_blocks, experts, BLOCK_N: gl.constexpr,
              GROUP_M: gl.constexpr, NUM_STAGES: gl.constexpr, GROUPED: gl.constexpr, SPLIT_K: gl.constexpr):
    """Copy every K block of this program's work items' A and B rows into the ring, one item after the
    other, each slot once both consumers have handed it back: the next item's first blocks land
    while the consumers store the last one."""
    nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
    it = 0  # K blocks copied so far: the ring's position
    for item in range(gl.program_id(0), _num_tiles(M, N, BLOCK_N) * SPLIT_K, gl.num_programs(0)):
        pid_m, pid_n, k_first, k_count = _work(item, M, N, k_blocks, BLOCK_N, GROUP_M, SPLIT_K)
        b_row = _expert(experts, pid_m, GROUPED) * N + pid_n * BLOCK_N
        for kb in range(k_first, k_first + k_count):
            slot = claim_slot(ready, empty, it, nbytes, NUM_STAGES)
            tma.async_copy_global_to_shared(a_desc, [pid_m * BLOCK_M, kb * BLOCK_K], ready.index(slot),
                                            a_ring.index(slot))
            tma.async_copy_global_to_shared(b_desc, [b_row, kb * BLOCK_K], ready.index(slot), b_ring.index(slot))
            it += 1


@gluon.jit
def _work(item, M, N, k_blocks, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr, SPLIT_K: gl.constexpr):
    """Work item ``item``: its tile ``(pid_m, pid_n)`` of C (``grouped_tile``) and its split's K blocks
    ``k_first ..< k_first + k_count``: split ``s = item % SPLIT_K`` takes blocks ``s k_blocks // SPLIT_K ..<
    (s + 1) k_blocks // SPLIT_K`` (all of them without a split)."""
    if SPLIT_K == 1:
        tile = item
        k_first = 0
        k_count = k_blocks
    else:
        tile = item // SPLIT_K
        split = item % SPLIT_K
        k_first = split * k_blocks // SPLIT_K
        k_count = (split + 1) * k_blocks // SPLIT_K - k_first
    pid_m, pid_n = grouped_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    return pid_m, pid_n, k_first, k_count


@gluon.jit
def ring_barriers(NUM_STAGES: gl.constexpr):
    """``(ready, empty)``, a ring's mbarriers: ``ready[s]`` completes when slot ``s``'s bytes have
    landed (the producer's TMA transaction count), ``empty[s]`` when both consumers have handed it back."""
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)
    return ready, empty


@gluon.jit
def claim_slot(ready, empty, it, nbytes: gl.constexpr, NUM_STAGES: gl.constexpr):
    """The ring's slot for K block ``it``, once both consumers have handed it back, set to complete
    ``ready`` when ``nbytes`` have landed in it."""
    slot = it % NUM_STAGES
    mbarrier.wait(empty.index(slot), (it // NUM_STAGES & 1) ^ 1)
    mbarrier.expect(ready.index(slot), nbytes)
    return slot


@gluon.jit
def _num_tiles(M, N, BLOCK_N: gl.constexpr):
    """The tiles of C."""
    return gl.cdiv(M, BLOCK_M) * gl.cdiv(N, BLOCK_N)


@gluon.jit
def _expert(experts, pid_m, GROUPED: gl.constexpr):
    """``GROUPED``: the expert of row block ``pid_m`` (``experts[0]``: ``block_expert``); else 0."""
    if GROUPED:
        return gl.load(experts[0] + pid_m)
    else:
        return 0


@gluon.jit
def _issue(a_ring, b_ring, ready, it, partial, WG: gl.constexpr, NUM_STAGES: gl.constexpr):
    """Once the ring's K block ``it`` has landed, start its wgmma over this warpgroup's 64 rows into
    ``partial`` (overwritten)."""
    slot = it % NUM_STAGES
    mbarrier.wait(ready.index(slot), it // NUM_STAGES & 1)
    return warpgroup_mma(a_ring.index(slot).slice(WG * 64, 64, dim=0), b_ring.index(slot).permute([1, 0]),
                         partial, use_acc=False, is_async=True)


@gluon.jit
def _hand_back(empty, it, NUM_STAGES: gl.constexpr):
    """The ring's K block ``it`` is done in this warpgroup's four warps: its slot is free for the producer."""
    gl.thread_barrier()
    mbarrier.arrive(empty.index(it % NUM_STAGES), count=1)


@gluon.jit
def _tile(a_ring, b_ring, ready, empty, c_out, a_scale_ptr, b_scale_ptr, M, N, stride_asm, stride_bsn, pid_m, pid_n,
          k_first, k_blocks, it, experts, mma: gl.constexpr, WG: gl.constexpr, BLOCK_N: gl.constexpr,
          NUM_STAGES: gl.constexpr, C_TMA: gl.constexpr, GROUPED: gl.constexpr, c_row0=0):
    """Rows ``64 WG ..`` of tile ``(pid_m, pid_n)`` over its ``k_blocks`` K blocks from ``k_first``, the
    first of them the ring's block ``it``: every K block's wgmma, folded with its scales, then stored
    (at C's rows ``c_row0`` further: a split's partial). Two partials in flight, as in ``gemm_sm90``
    (K blocks in pairs, each register set's next wgmma writing over its folded partial, the folds
    volatile): a K block's fold runs under the next one's wgmma."""
    rows = pid_m * BLOCK_M + WG * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, mma))
    cols = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma))
    mask_rows = rows < M
    a_scales = a_scale_ptr + rows.to(gl.int64) * stride_asm + k_first
    b_scale = b_scale_ptr + (pid_n * BLOCK_N // BLOCK_K).to(gl.int64) * stride_bsn + k_first
    if GROUPED:  # this row block's expert's weight scales
        b_scale += _expert(experts, pid_m, GROUPED).to(gl.int64) * experts[4]
    acc = gl.zeros([64, BLOCK_N], gl.float32, layout=mma)
    odd_done = gl.zeros([64, BLOCK_N], gl.float32, layout=mma)
    even = _issue(a_ring, b_ring, ready, it, gl.zeros([64, BLOCK_N], gl.float32, layout=mma), WG, NUM_STAGES)
    scale = _row_scale(a_scales, b_scale, 0, mask_rows)
    for pair in range((k_blocks - 1) // 2):
        kb = 2 * pair + 1
        odd = _issue(a_ring, b_ring, ready, it + kb, odd_done, WG, NUM_STAGES)
        even_done = warpgroup_mma_wait(num_outstanding=1, deps=[even])
        _hand_back(empty, it + kb - 1, NUM_STAGES)
        acc = _fold(acc, even_done, scale)
        scale = _row_scale(a_scales, b_scale, kb, mask_rows)  # while the wgmma of kb runs
        even = _issue(a_ring, b_ring, ready, it + kb + 1, even_done, WG, NUM_STAGES)
        odd_done = warpgroup_mma_wait(num_outstanding=1, deps=[odd])
        _hand_back(empty, it + kb, NUM_STAGES)
        acc = _fold(acc, odd_done, scale)
        scale = _row_scale(a_scales, b_scale, kb + 1, mask_rows)
    if k_blocks % 2 == 0:  # one K block left
        odd = _issue(a_ring, b_ring, ready, it + k_blocks - 1, odd_done, WG, NUM_STAGES)
        even_done = warpgroup_mma_wait(num_outstanding=1, deps=[even])
        _hand_back(empty, it + k_blocks - 2, NUM_STAGES)
        acc = _fold(acc, even_done, scale)
        scale = _row_scale(a_scales, b_scale, k_blocks - 1, mask_rows)
        odd_done = warpgroup_mma_wait(num_outstanding=0, deps=[odd])
        _hand_back(empty, it + k_blocks - 1, NUM_STAGES)
        acc = _fold(acc, odd_done, scale)
    else:
        even_done = warpgroup_mma_wait(num_outstanding=0, deps=[even])
        _hand_back(empty, it + k_blocks - 1, NUM_STAGES)
        acc = _fold(acc, even_done, scale)
    if GROUPED and experts[2] is not None:  # each row's routing weight, by its pair (0 for padding rows)
        pair = gl.load(experts[1] + rows, mask=mask_rows, other=experts[3])
        paired = pair < experts[3]
        acc = acc * gl.load(experts[2] + pair, mask=paired, other=0.0)[:, None]
        # Only the pairs' rows are read after (``moe.sum_slots``): 64 rows of pairs go by bulk store, fewer from
        # registers, none not at all (a run of a few pairs would otherwise store its 128 rows)
        if not C_TMA:
            _store_rows(c_out[0], c_out[1], acc, rows, cols, paired, N, 0)
        elif gl.sum(paired.to(gl.int32), axis=0) == 64:
            _bulk_store(c_out, acc, pid_m, pid_n, WG, BLOCK_N)
        else:
            _store_rows(c_out[2], c_out[3], acc, rows, cols, paired, N, 0)
    elif C_TMA:
        _bulk_store(c_out, acc, pid_m, pid_n, WG, BLOCK_N)
    else:
        _store_rows(c_out[0], c_out[1], acc, rows, cols, mask_rows, N, c_row0)


@gluon.jit
def _bulk_store(c_out, acc, pid_m, pid_n, WG: gl.constexpr, BLOCK_N: gl.constexpr):
    """This warpgroup's 64 rows of the tile by a bulk tensor store, through its shared buffer once the bulk
    store of its last tile has read it (``c_out``: C's descriptor and the consumers' shared buffers)."""
    c_desc = c_out[0]
    c_buf = c_out[1].index(WG)
    tma.store_wait(0)
    gl.thread_barrier()
    c_buf.store(acc.to(c_desc.dtype))
    fence_async_shared()
    gl.thread_barrier()
    tma.async_copy_shared_to_global(c_desc, [pid_m * BLOCK_M + WG * 64, pid_n * BLOCK_N], c_buf)


@gluon.jit
def _store_rows(c_ptr, stride_cm, acc, rows, cols, mask_rows, N, c_row0):
    """The ``mask_rows`` of ``acc`` at C's ``rows`` (``c_row0`` further), from registers."""
    c = c_ptr + (rows.to(gl.int64) + c_row0)[:, None] * stride_cm + cols[None, :]
    gl.store(c, acc.to(c_ptr.dtype.element_ty), mask=mask_rows[:, None] & (cols < N)[None, :])


@gluon.jit
def _consumer(a_ring, b_ring, ready, empty, c_out, a_scale_ptr, b_scale_ptr, M, N, stride_asm, stride_bsn, k_blocks,
              experts, WG: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr, NUM_STAGES: gl.constexpr,
              C_TMA: gl.constexpr, GROUPED: gl.constexpr, SPLIT_K: gl.constexpr):
    """Consumer warpgroup ``WG``: its 64 rows of each of this program's work items, in the producer's order.
    ``c_out``: C's descriptor and the consumers' shared buffers (``C_TMA``), then, where rows are stored from
    registers, C's pointer and row stride (with ``SPLIT_K``, the fp32 partials ``[SPLIT_K, M, N]``)."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 32])
    it = 0
    for item in range(gl.program_id(0), _num_tiles(M, N, BLOCK_N) * SPLIT_K, gl.num_programs(0)):
        pid_m, pid_n, k_first, k_count = _work(item, M, N, k_blocks, BLOCK_N, GROUP_M, SPLIT_K)
        _tile(a_ring, b_ring, ready, empty, c_out, a_scale_ptr, b_scale_ptr, M, N, stride_asm, stride_bsn, pid_m,
              pid_n, k_first, k_count, it, experts, mma, WG, BLOCK_N, NUM_STAGES, C_TMA, GROUPED,
              item % SPLIT_K * M)
        it += k_count
    if C_TMA:
        tma.store_wait(0)  # the shared buffer outlives the last bulk store


@gluon.jit
def block_scaled_gemm_kernel_sm90_ws(
    a_desc, b_desc, c_ptr, a_scale_ptr, b_scale_ptr,
    M, N, K, stride_cm, stride_asm, stride_bsn,
    BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr, NUM_STAGES: gl.constexpr, c_desc=None, C_TMA: gl.constexpr = False,
    rows_in_use_ptr=None, block_expert_ptr=None, sorted_ids_ptr=None, weights_ptr=None, num_pairs=0, stride_bse=0,
    GROUPED: gl.constexpr = False, SPLIT_K: gl.constexpr = 1,
):
    """Persistent: program ``p`` of ``P`` takes the ``128 x BLOCK_N`` tiles ``p, p + P, ...`` of C
    (``grid``; ordered by ``gemm_sm90.grouped_tile``), each over all K blocks, through one ring.
    ``a_desc``: boxes of ``[128, 128]`` over A ``[M, K]``; ``b_desc``: ``[BLOCK_N, 128]`` over B
    ``[N, K]``, both 128-byte swizzled (``descriptors``).

    ``GROUPED`` (the fused MoE's second GEMM, ``moe.ExpertRuns`` with 128-row runs): A's rows are
    sorted by expert, and B ``[E * N, K]`` stacks the experts' weights; row block ``m`` takes
    expert ``block_expert[m]``'s rows of B and of ``b_scale`` (``stride_bse`` apart), only the
    ``rows_in_use[0]`` rows of runs are computed (``M`` bounds the descriptors), and, given
    ``weights_ptr``, each row of C is multiplied by ``weights[sorted_ids[row]]`` (0 where that is
    ``num_pairs``, a padding row) and only the pairs' rows are stored; without it C's padding rows hold
    whatever A's padding rows give.

    ``SPLIT_K`` > 1 (not grouped; ``splits_fit``): each tile is ``SPLIT_K`` work items, each over its
    share of the K blocks (``_work``), and ``c_ptr`` the fp32 partials ``[SPLIT_K, M, N]`` (``stride_cm`` =
    N, stored from registers) that ``gemm._split_k_sum_kernel`` adds up."""
    gl.static_assert(gl.num_warps() == NUM_WARPS and BLOCK_N <= BLOCK_K and NUM_STAGES >= 2)
    gl.static_assert(SPLIT_K == 1 or not (GROUPED or C_TMA))
    k_blocks = gl.cdiv(K, BLOCK_K)
    if GROUPED:
        M = gl.load(rows_in_use_ptr)
    experts = (block_expert_ptr, sorted_ids_ptr, weights_ptr, num_pairs, stride_bse)

    a_ring = gl.allocate_shared_memory(a_desc.dtype, [NUM_STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
    b_ring = gl.allocate_shared_memory(b_desc.dtype, [NUM_STAGES, BLOCK_N, BLOCK_K], b_desc.layout)
    ready, empty = ring_barriers(NUM_STAGES)
    if C_TMA:  # C by bulk stores, through a shared buffer a consumer
        c_bufs = gl.allocate_shared_memory(c_desc.dtype, [2, 64, BLOCK_N], c_desc.layout)
        if GROUPED and weights_ptr is not None:  # and boxes with padding rows from registers (``_tile``)
            c_out = (c_desc, c_bufs, c_ptr, stride_cm)
        else:  # (a pointer the partitions take but do not use fails Triton 3.6's lowering)
            c_out = (c_desc, c_bufs)
    else:
        c_out = (c_ptr, stride_cm)
    fence_async_shared()

    gl.warp_specialize([
        (_consumer, (a_ring, b_ring, ready, empty, c_out, a_scale_ptr, b_scale_ptr, M, N, stride_asm, stride_bsn,
                     k_blocks, experts, 0, BLOCK_N, GROUP_M, NUM_STAGES, C_TMA, GROUPED, SPLIT_K)),
        (_consumer, (a_ring, b_ring, ready, empty, c_out, a_scale_ptr, b_scale_ptr, M, N, stride_asm, stride_bsn,
                     k_blocks, experts, 1, BLOCK_N, GROUP_M, NUM_STAGES, C_TMA, GROUPED, SPLIT_K)),
        (_producer, (a_desc, b_desc, a_ring, b_ring, ready, empty, M, N, k_blocks, experts, BLOCK_N, GROUP_M,
                     NUM_STAGES, GROUPED, SPLIT_K)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def grid(m: int, n: int, block_n: int, device: torch.device, block_m: int = BLOCK_M.value,
         split_k: int = 1) -> tuple[int]:
    """One program a multiprocessor, or a program a work item (``block_m x block_n`` tile, or one of its
    ``split_k`` K splits) where there are fewer."""
    return (min(triton.cdiv(m, block_m) * triton.cdiv(n, block_n) * split_k, _num_sms(device.index)),)


@functools.cache
def _num_sms(device_index: int) -> int:
    """The GPU's multiprocessors (asked once: a device query costs host time every launch)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count
