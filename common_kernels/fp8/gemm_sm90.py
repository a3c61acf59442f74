"""The block-scaled fp8 GEMM for Hopper (sm_90), in Gluon: two K blocks' wgmma in flight.

Same contract as ``gemm._block_scaled_gemm_kernel`` without K splits (the ``gemm`` module
docstring has the formula): ``C [M, N] = sum_kb a_scale[:, kb] * b_scale[:, kb] * A[:, kb] B[:, kb]^T``,
one fp32 partial per 128-wide K block, scaled before it joins the fp32 accumulator. A tuned
table selects it per shape with ``"KERNEL": "sm90"`` in a config.

Why a second kernel: the partial of K block ``kb`` is needed in registers, scaled, before the
next block joins, so Triton waits for each wgmma before issuing the next (``wgmma.wait_group 0``
every K block) and the tensor cores idle while the scales are applied. Here the partial of
``kb + 1`` is issued before the one of ``kb`` is waited for (``warpgroup_mma_wait(1)``), so the
scaling of one block runs under the next block's wgmma. That takes two fp32 partials beside the
accumulator: ``3 * BLOCK_N / 2`` registers a thread (192 at ``BLOCK_N = 128``), hence
``BLOCK_N <= 128``; ``BLOCK_M`` is 64 rows a warpgroup (4 or 8 warps). A tile's columns then lie
in one 128-wide weight block: its ``b_scale`` is one value per K block.

Compiled for sm_90a (``benchmarks/hopper_compile.py``): 128 x 128 tiles take 255 registers, no
spills; 128 x 64 take 156. Two constructs keep ptxas from serializing the wgmma (it waits after
each one when any other instruction copies or defines an in-flight accumulator, C7514/C7515):
K blocks go in pairs, each register set's next wgmma overwriting its own folded partial, and the
scaling multiply-adds are volatile inline assembly, which LLVM cannot sink below the next wgmma.

Operands: ``cp.async`` copies (16 bytes a thread; masked rows and the K tail are zero-filled) into
a ring of ``NUM_STAGES`` shared buffers. Two slots belong to the two wgmma in flight, so
``NUM_STAGES - 2`` tiles are copied ahead. A slot is refilled two K blocks after its wgmma was
issued, once every warpgroup has waited for it (the barrier at the top of each K block).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

ROWS_PER_WARPGROUP = 64
# (BLOCK_M, BLOCK_N, num_warps) of the configs the tuner tries and the GPU tests cover
TILES = ((128, 128, 8), (128, 64, 8), (64, 64, 4))


def fits(config: dict) -> bool:
    """Whether this kernel takes a launch config (``BLOCK_K`` is always 128)."""
    return (config.get("SPLIT_K", 1) == 1 and config["BLOCK_N"] in (64, 128) and config["num_warps"] in (4, 8)
            and config["BLOCK_M"] == ROWS_PER_WARPGROUP * config["num_warps"] // 4 and config["num_stages"] >= 3)


@gluon.jit
def _issue_k_block(a_ring, b_ring, kb, a_rows, b_rows, mask_m, mask_n, K, BLOCK_K: gl.constexpr,
                   NUM_STAGES: gl.constexpr, ld: gl.constexpr):
    """Start copying K block ``kb`` of this tile's A rows and B rows into ring slot
    ``kb % NUM_STAGES`` as one commit group (past K: an empty group, so counts stay uniform)."""
    offs_k = kb * BLOCK_K + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, ld))
    mask_k = (offs_k < K)[None, :]
    slot = kb % NUM_STAGES
    async_copy.async_copy_global_to_shared(a_ring.index(slot), a_rows + offs_k[None, :], mask=mask_m & mask_k)
    async_copy.async_copy_global_to_shared(b_ring.index(slot), b_rows + offs_k[None, :], mask=mask_n & mask_k)
    async_copy.commit_group()


@gluon.jit
def _start_k_block(a_ring, b_ring, kb, regs, a_rows, b_rows, mask_m, mask_n, K, BLOCK_K: gl.constexpr,
                   NUM_STAGES: gl.constexpr, ld: gl.constexpr):
    """Wait until K block ``kb`` has landed for every thread (and every warpgroup has waited for
    the wgmma of ``kb - 2``), refill that wgmma's slot with block ``kb + NUM_STAGES - 2``, and
    issue the wgmma of ``kb`` into a fresh fp32 partial (asynchronous) in the registers of
    ``regs``, a partial already folded in (its values are not read)."""
    async_copy.wait_group(NUM_STAGES - 3)
    fence_async_shared()
    gl.thread_barrier()
    _issue_k_block(a_ring, b_ring, kb + NUM_STAGES - 2, a_rows, b_rows, mask_m, mask_n, K, BLOCK_K, NUM_STAGES, ld)
    slot = kb % NUM_STAGES
    return warpgroup_mma(a_ring.index(slot), b_ring.index(slot).permute([1, 0]), regs, use_acc=False, is_async=True)


@gluon.jit
def _fold(acc, partial, row_scale):
    """``acc + partial * row_scale[:, None]`` for a waited partial, as volatile inline assembly:
    plain multiply-adds may be scheduled after the next wgmma that writes over ``partial``,
    which then needs a copy of in-flight registers (and ptxas serializes every wgmma, C7515)."""
    return gl.inline_asm_elementwise("fma.rn.f32 $0, $1, $2, $3;", "=r,r,r,r", [partial, row_scale[:, None], acc],
                                     dtype=gl.float32, is_pure=False, pack=1)


@gluon.jit
def _row_scale(a_scales, b_scale, kb, mask_rows):
    """``a_scale[rows, kb] * b_scale[tile's 128 columns, kb]``: a tile's columns share one weight block."""
    return gl.load(a_scales + kb, mask=mask_rows, other=0.0) * gl.load(b_scale + kb)


@gluon.jit
def grouped_tile(pid, M, N, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr):
    """Tile ``pid``'s place ``(pid_m, pid_n)`` in C, tiles ordered in groups of ``GROUP_M`` rows of
    tiles, as the Triton kernel orders them (neighbouring tiles share A rows and B columns in L2)."""
    tiles_n = gl.cdiv(N, BLOCK_N)
    first_m = pid // (GROUP_M * tiles_n) * GROUP_M
    rows_in_group = gl.minimum(gl.cdiv(M, BLOCK_M) - first_m, GROUP_M)
    return first_m + (pid % (GROUP_M * tiles_n)) % rows_in_group, (pid % (GROUP_M * tiles_n)) // rows_in_group


@gluon.jit
def block_scaled_gemm_kernel_sm90(
    a_ptr, b_ptr, c_ptr, a_scale_ptr, b_scale_ptr,
    M, N, K, stride_am, stride_bn, stride_cm, stride_asm, stride_bsn,
    BLOCK_K: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr,
    NUM_STAGES: gl.constexpr,
):
    """One ``BLOCK_M x BLOCK_N`` tile of C over all K blocks (``grouped_tile``)."""
    gl.static_assert(BLOCK_M == 16 * gl.num_warps() and BLOCK_N <= 128 and NUM_STAGES >= 3)
    in_ty: gl.constexpr = a_ptr.dtype.element_ty
    ld: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [gl.num_warps(), 1], [1, 0])  # 16 fp8 values a copy
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                  instr_shape=[16, BLOCK_N, 32])

    pid_m, pid_n = grouped_tile(gl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)

    offs_m = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, ld))
    offs_n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld))
    a_rows = a_ptr + offs_m.to(gl.int64)[:, None] * stride_am
    b_rows = b_ptr + offs_n.to(gl.int64)[:, None] * stride_bn
    mask_m = (offs_m < M)[:, None]
    mask_n = (offs_n < N)[:, None]
    a_ring = gl.allocate_shared_memory(in_ty, [NUM_STAGES, BLOCK_M, BLOCK_K],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], in_ty))
    b_ring = gl.allocate_shared_memory(b_ptr.dtype.element_ty, [NUM_STAGES, BLOCK_N, BLOCK_K],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], b_ptr.dtype.element_ty))

    # the scales: a_scale per row, in the partials' layout; b_scale of the tile's weight block
    rows_c = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma))
    cols_c = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma))
    a_scales = a_scale_ptr + rows_c.to(gl.int64) * stride_asm
    b_scale = b_scale_ptr + (pid_n * BLOCK_N // BLOCK_K).to(gl.int64) * stride_bsn
    mask_rows = rows_c < M
    mask_cols = cols_c < N

    k_blocks = gl.cdiv(K, BLOCK_K)
    for ahead in gl.static_range(NUM_STAGES - 2):
        _issue_k_block(a_ring, b_ring, ahead, a_rows, b_rows, mask_m, mask_n, K, BLOCK_K, NUM_STAGES, ld)
    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=mma)
    # Two partials in flight, in two register sets that alternate: K blocks go in pairs, and
    # each set's next wgmma writes over its folded partial (the registers are tied through the
    # loop), so no in-flight partial is ever copied: a copy makes ptxas serialize every wgmma
    # (C7514 / C7515).
    odd_done = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=mma)
    even_regs = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=mma)
    even = _start_k_block(a_ring, b_ring, 0, even_regs, a_rows, b_rows, mask_m, mask_n, K, BLOCK_K, NUM_STAGES, ld)
    scale = _row_scale(a_scales, b_scale, 0, mask_rows)
    for pair in range((k_blocks - 1) // 2):
        kb = 2 * pair + 1
        odd = _start_k_block(a_ring, b_ring, kb, odd_done, a_rows, b_rows, mask_m, mask_n, K, BLOCK_K, NUM_STAGES, ld)
        even_done = warpgroup_mma_wait(num_outstanding=1, deps=[even])
        acc = _fold(acc, even_done, scale)
        scale = _row_scale(a_scales, b_scale, kb, mask_rows)  # while the wgmma of kb runs
        even = _start_k_block(a_ring, b_ring, kb + 1, even_done, a_rows, b_rows, mask_m, mask_n, K, BLOCK_K,
                              NUM_STAGES, ld)
        odd_done = warpgroup_mma_wait(num_outstanding=1, deps=[odd])
        acc = _fold(acc, odd_done, scale)
        scale = _row_scale(a_scales, b_scale, kb + 1, mask_rows)
    if k_blocks % 2 == 0:  # one K block left
        odd = _start_k_block(a_ring, b_ring, k_blocks - 1, odd_done, a_rows, b_rows, mask_m, mask_n, K, BLOCK_K,
                             NUM_STAGES, ld)
        acc = _fold(acc, warpgroup_mma_wait(num_outstanding=1, deps=[even]), scale)
        scale = _row_scale(a_scales, b_scale, k_blocks - 1, mask_rows)
        acc = _fold(acc, warpgroup_mma_wait(num_outstanding=0, deps=[odd]), scale)
    else:
        acc = _fold(acc, warpgroup_mma_wait(num_outstanding=0, deps=[even]), scale)
    async_copy.wait_group(0)

    c = c_ptr + rows_c.to(gl.int64)[:, None] * stride_cm + cols_c[None, :]
    gl.store(c, acc.to(c_ptr.dtype.element_ty), mask=mask_rows[:, None] & mask_cols[None, :])
