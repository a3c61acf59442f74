"""Dynamic per-token-group fp8 quantization of activations (DeepSeek-V3's 1 x 128 groups), and
per token (one scale per row: ``quantize_per_token``, the same formula with the row as its group).

For row ``m`` and group ``g`` (columns ``[g * G, (g + 1) * G)``)::

    s[m, g] = max(amax(x[m, group]), eps) / fp8_max        (rounded up to a power of two on request)
    q[m, k] = fp8(clamp(x[m, k] / s[m, g], -fp8_max, fp8_max))

Output ``q [M, K]`` E4M3 (or E5M2), scales ``s [M, cdiv(K, G)]`` fp32, the layout the block-scaled
GEMM reads. Non-finite inputs make their group's scale non-finite; they are counted into
``stats[1]`` (``common_kernels.guard``) so the engine can warn or stop instead of multiplying
garbage. With dynamic scales nothing saturates unless a scale is forced to a power of two, which
never rounds it down.
"""

import torch
import triton
import triton.language as tl

from ..fp8_format import FP8_DTYPES, fp8_finite_max


QUANT_EPS = 1e-10  # the default floor of a group's absolute maximum
GROUP_BLOCK_ROWS = 16  # rows per program of the group quantizer


@triton.jit
def max_nan(a, b):
    """``max`` that keeps a NaN operand (a GPU's default ``max`` drops it, the interpreter's keeps
    it): as a reduction's combine function, a NaN input reaches its group's scale."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def scale_of(amax, eps, FP8_MAX: tl.constexpr, POW2_SCALE: tl.constexpr):
    """The scale for an absolute maximum ``amax`` (NaN stays NaN, infinity infinite)."""
    scale = tl.math.div_rn(max_nan(amax, eps), FP8_MAX)
    if POW2_SCALE:
        # Up to the next power of two, exactly: carry any mantissa bit into the exponent (a NaN's
        # bits would carry out of it).
        pow2 = ((scale.to(tl.int32, bitcast=True) + 0x7FFFFF) & 0x7F800000).to(tl.float32, bitcast=True)
        scale = tl.where(scale == scale, pow2, scale)
    return scale


@triton.jit
def group_amax(x):
    """The absolute maximum of ``x`` along its last axis, kept as 1 (NaN kept: ``max_nan``)."""
    return tl.reduce(tl.abs(x), len(x.shape) - 1, max_nan, keep_dims=True)


@triton.jit
def quantize_by_scale(x, scale, FP8_MAX: tl.constexpr):
    """``x / scale`` in fp32, clamped to the fp8 range; the cast that stores it rounds to the fp8 grid.

    One division a scale, not a value (Triton's `/` is approximate on GPUs, ``div_rn`` costs about
    ten instructions): the product with the correctly rounded reciprocal, corrected by one fused
    step, is the correctly rounded quotient wherever that is a normal fp32 number (Markstein's
    theorem); below that every fp8 format rounds it to zero anyway. An infinite scale gives
    ``x * 0``, as ``x / inf`` does."""
    inv = tl.math.div_rn(1.0, scale)
    q = x * inv
    q = tl.where(inv != 0, tl.math.fma(tl.math.fma(-q, scale, x), inv, q), q)
    return tl.minimum(tl.maximum(q, -FP8_MAX), FP8_MAX)


@triton.jit
def quantize_groups(x, eps, FP8_MAX: tl.constexpr, POW2_SCALE: tl.constexpr):
    """``x`` (fp32) quantized per group along its last axis: ``(values in fp32 that the fp8 cast
    makes bit-equal to the reference, scales)``, the scales with the last axis kept as 1."""
    scale = scale_of(group_amax(x), eps, FP8_MAX, POW2_SCALE)
    return quantize_by_scale(x, scale, FP8_MAX), scale


@triton.jit
def add_nonfinite(stats_ptr, x, mask):
    """Add the NaN and infinite values of ``x [ROWS, COLS]`` where ``mask`` holds to the guard's
    ``stats[1]``, a row at a time: a row's count is a reduction along the axis the group maximum
    already reduced, and only rows that hold one issue an atomic. On an H100 a sum over the whole tile
    and an atomic a program cost the group and SiLU quantizers 4-17 % (the RMSNorm one 16-60 %), this
    0-5 % (7-26 %): ``benchmarks/results/fp8-guard-count-h100-2026-12-05.md``."""
    per_row = tl.sum((((x != x) | (tl.abs(x) == float("inf"))) & mask).to(tl.int32), 1)
    # one address for every row (``zeros_like`` would need a layout in Gluon)
    tl.atomic_add(stats_ptr + 1 + per_row * 0, per_row, mask=per_row != 0)


def check_group_format(group_size: int, fp8_dtype: torch.dtype) -> None:
    """Refuse a group size or fp8 format the group quantizers do not take, naming it."""
    if group_size < 16 or group_size & (group_size - 1):
        raise ValueError(f"group_size={group_size} is not supported: a power of two >= 16 is")
    if fp8_dtype not in FP8_DTYPES:
        raise ValueError(f"fp8_dtype {fp8_dtype} is not supported: one of {FP8_DTYPES} is")


def check_rows_limit(rows_limit: torch.Tensor | None, device: torch.device) -> None:
    """A row count on the device (``rows_limit``) must be an int32 tensor of one element there."""
    if rows_limit is not None and (not isinstance(rows_limit, torch.Tensor) or rows_limit.dtype != torch.int32
                                   or rows_limit.numel() != 1 or rows_limit.device != device):
        raise ValueError(f"rows_limit must be an int32 tensor of one element on {device}, got {rows_limit!r}")


@triton.jit
def group_tile(num_rows, num_cols, GROUP: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    """This program's ``BLOCK_ROWS`` rows and group (axis 0 and 1 of the grid): ``(rows, group,
    column offsets, in-bounds mask)``."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    group = tl.program_id(1)
    offs = group * GROUP + tl.arange(0, GROUP)
    return rows, group, offs, (rows < num_rows)[:, None] & (offs < num_cols)[None, :]


@triton.jit
def store_quantized_groups(x, rows, offs, mask, group, num_rows, q_ptr, scale_ptr, stats_ptr, stride_q, stride_s, eps,
                           FP8_MAX: tl.constexpr, POW2_SCALE: tl.constexpr, TRACK_STATS: tl.constexpr):
    """``x [BLOCK_ROWS, GROUP]`` (fp32; ``rows``, column offsets ``offs``, ``mask``) quantized as one
    group per row, its values and the rows' scales (column ``group``) stored, its non-finite values
    counted into ``stats[1]``."""
    y, scale = quantize_groups(x, eps, FP8_MAX, POW2_SCALE)  # scale [BLOCK_ROWS, 1]
    tl.store(q_ptr + rows[:, None] * stride_q + offs[None, :], y.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + rows[:, None] * stride_s + group, scale, mask=(rows < num_rows)[:, None])
    if TRACK_STATS:
        add_nonfinite(stats_ptr, x, mask)


@triton.jit
def _group_quant_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    stats_ptr,
    num_rows,
    num_cols,
    stride_x_m,
    stride_q_m,
    stride_s_m,
    eps,
    GROUP: tl.constexpr,
    FP8_MAX: tl.constexpr,
    POW2_SCALE: tl.constexpr,
    TRACK_STATS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    rows_limit_ptr=None,
):
    """One group of ``BLOCK_ROWS`` rows: a program of 128 threads per 128 values would be all
    launch and no work (a DeepSeek-V3 MoE at 4096 tokens quantizes 0.75 M groups). With
    ``rows_limit_ptr``, rows from ``rows_limit_ptr[0]`` on are left alone."""
    if rows_limit_ptr is not None:
        num_rows = tl.minimum(num_rows, tl.load(rows_limit_ptr))
    rows, group, offs, mask = group_tile(num_rows, num_cols, GROUP, BLOCK_ROWS)
    x = tl.load(x_ptr + rows[:, None] * stride_x_m + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    store_quantized_groups(x, rows, offs, mask, group, num_rows, q_ptr, scale_ptr, stats_ptr, stride_q_m, stride_s_m,
                           eps, FP8_MAX, POW2_SCALE, TRACK_STATS)


def quantize_per_token_group(
    x: torch.Tensor,
    group_size: int = 128,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    pow2_scale: bool = False,
    eps: float = QUANT_EPS,
    stats: torch.Tensor | None = None,
    rows_limit: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize each ``group_size`` columns of each row of ``x`` to fp8 with its own scale.

    Args:
        x: ``[M, K]`` bf16/fp16/fp32, last dim contiguous; ``K`` need not divide by the group.
        group_size: columns per scale, a power of two >= 16 (128 for DeepSeek-V3).
        fp8_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        pow2_scale: round every scale up to a power of two (exact rescaling, DeepGEMM's UE8M0).
        eps: floor of a group's absolute maximum (an all-zero group gets scale eps / fp8_max).
        stats: optional ``[2]`` int32 guard counters; non-finite inputs are added to ``stats[1]``.
        rows_limit: optional int32 ``[1]`` on x's device: only the rows before ``rows_limit[0]`` are
            read, quantized and counted; the outputs' later rows are left unwritten (a row count known
            on the device only, as the fused MoE's rows in use).

    Returns:
        ``(q [M, K] fp8, scales [M, cdiv(K, group_size)] fp32)``; ``x ≈ q * scales`` per group.
    """
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be a [M, K] tensor with a contiguous last dim, got {tuple(x.shape)}")
    check_group_format(group_size, fp8_dtype)
    check_rows_limit(rows_limit, x.device)
    rows, cols = x.shape
    groups = triton.cdiv(cols, group_size)
    q = torch.empty(rows, cols, dtype=fp8_dtype, device=x.device)
    scales = torch.empty(rows, groups, dtype=torch.float32, device=x.device)
    if rows and cols:
        fp8_max = fp8_finite_max(fp8_dtype)
        block_rows = min(GROUP_BLOCK_ROWS, triton.next_power_of_2(rows))
        _group_quant_kernel[(triton.cdiv(rows, block_rows), groups)](
            x, q, scales, stats if stats is not None else scales, rows, cols, x.stride(0), q.stride(0),
            scales.stride(0), eps, GROUP=group_size, FP8_MAX=fp8_max, POW2_SCALE=pow2_scale,
            TRACK_STATS=stats is not None, BLOCK_ROWS=block_rows, rows_limit_ptr=rows_limit,
        )
    return q, scales


@triton.jit
def _token_quant_kernel(
    x_ptr, q_ptr, scale_ptr, stats_ptr, num_cols, stride_x_m, stride_q_m, eps,
    BLOCK: tl.constexpr, FP8_MAX: tl.constexpr,
    POW2_SCALE: tl.constexpr, TRACK_STATS: tl.constexpr,
):
    """One row: its absolute maximum over ``BLOCK``-wide chunks, then the chunks quantized."""
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros([BLOCK], tl.float32)
    nonfinite = tl.zeros([BLOCK], tl.int32)
    for start in range(0, num_cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x_m + offs, mask=offs < num_cols, other=0.0).to(tl.float32)
        amax = max_nan(amax, tl.abs(x))
        nonfinite += ((x != x) | (tl.abs(x) == float("inf"))).to(tl.int32)
    scale = scale_of(tl.reduce(amax, 0, max_nan), eps, FP8_MAX, POW2_SCALE)
    for start in range(0, num_cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x_m + offs, mask=offs < num_cols, other=0.0).to(tl.float32)
        y = quantize_by_scale(x, scale, FP8_MAX)
        tl.store(q_ptr + row * stride_q_m + offs, y.to(q_ptr.dtype.element_ty), mask=offs < num_cols)
    tl.store(scale_ptr + row, scale)
    if TRACK_STATS:
        tl.atomic_add(stats_ptr + 1, tl.sum(nonfinite, 0))


def quantize_per_token(
    x: torch.Tensor,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    pow2_scale: bool = False,
    eps: float = QUANT_EPS,
    stats: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize each row of ``x [M, K]`` (any K) to fp8 with one scale per row.

    Same arguments and formula as ``quantize_per_token_group`` with the whole row as the group.
    Returns ``(q [M, K] fp8, scales [M, 1] fp32)``. Non-finite inputs are counted into
    ``stats[1]`` when given (the row's scale then need not be finite).
    """
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be a [M, K] tensor with a contiguous last dim, got {tuple(x.shape)}")
    if fp8_dtype not in FP8_DTYPES:
        raise ValueError(f"fp8_dtype {fp8_dtype} is not supported: one of {FP8_DTYPES} is")
    rows, cols = x.shape
    q = torch.empty(rows, cols, dtype=fp8_dtype, device=x.device)
    scales = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows and cols:
        fp8_max = fp8_finite_max(fp8_dtype)
        _token_quant_kernel[(rows,)](
            x, q, scales, stats if stats is not None else scales, cols, x.stride(0), q.stride(0), eps,
            BLOCK=min(1024, triton.next_power_of_2(cols)), FP8_MAX=fp8_max, POW2_SCALE=pow2_scale,
            TRACK_STATS=stats is not None,
        )
    return q, scales


@triton.jit
def _weight_block_quant_kernel(
    w_ptr, q_ptr, scale_ptr, stats_ptr, num_rows, num_cols, stride_w, stride_q, stride_s, eps,
    BLOCK: tl.constexpr, FP8_MAX: tl.constexpr,
    TRACK_STATS: tl.constexpr,
):
    block_n = tl.program_id(0)
    block_k = tl.program_id(1)
    rows = (block_n * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    cols = block_k * BLOCK + tl.arange(0, BLOCK)
    mask = (rows < num_rows)[:, None] & (cols < num_cols)[None, :]
    w = tl.load(w_ptr + rows[:, None] * stride_w + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    scale = scale_of(tl.reduce(tl.reduce(tl.abs(w), 1, max_nan), 0, max_nan), eps, FP8_MAX, False)
    y = quantize_by_scale(w, scale, FP8_MAX)
    tl.store(q_ptr + rows[:, None] * stride_q + cols[None, :], y.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + block_n * stride_s + block_k, scale)
    if TRACK_STATS:  # one sum over the block: a count per row spills on this 128 x 128 tile
        nonfinite = tl.sum(tl.sum(((w != w) | (tl.abs(w) == float("inf"))).to(tl.int32), 1), 0)
        tl.atomic_add(stats_ptr + 1, nonfinite)


def quantize_weight_blocks(
    w: torch.Tensor, fp8_dtype: torch.dtype = torch.float8_e4m3fn, block: int = 128, eps: float = QUANT_EPS,
    stats: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a weight ``[N, K]`` to fp8 with one scale per ``block x block`` tile::

        s[i, j] = max(amax(tile i, j), eps) / fp8_max,   q = fp8(w / s)

    Returns ``(q [N, K], s [cdiv(N, block), cdiv(K, block)] fp32)``: DeepSeek-V3's ``weight`` /
    ``weight_scale_inv`` layout, which ``block_scaled_gemm`` reads. Non-finite weights are counted
    into ``stats[1]`` when given (and make their tile's scale non-finite).
    """
    if w.dim() != 2 or w.stride(-1) != 1:
        raise ValueError(f"w must be a 2-D weight with a contiguous last dim, got {tuple(w.shape)}")
    if block < 16 or block & (block - 1):
        raise ValueError(f"block {block} is not supported: a power of two >= 16 is")
    fp8_max = fp8_finite_max(fp8_dtype)
    rows, cols = w.shape
    grid = (triton.cdiv(rows, block), triton.cdiv(cols, block))
    q = torch.empty(rows, cols, dtype=fp8_dtype, device=w.device)
    scales = torch.empty(grid, dtype=torch.float32, device=w.device)
    if rows and cols:
        _weight_block_quant_kernel[grid](
            w, q, scales, stats if stats is not None else scales, rows, cols, w.stride(0), q.stride(0),
            scales.stride(0), eps, BLOCK=block, FP8_MAX=fp8_max, TRACK_STATS=stats is not None,
        )
    return q, scales
