"""SiLU-and-mul fused with the per-token-group fp8 quantization of its output (the producer of the
``down_proj`` input in DeepSeek-V3's dense MLPs and shared experts).

For row ``m`` of ``x [M, 2 * D]`` (gate columns ``[0, D)``, up columns ``[D, 2 * D)``)::

    y[m] = dtype(dtype(silu(gate[m])) * up[m])          (vLLM's SiluAndMul, rounded as it is)
    q, s = quantize_per_token_group(y, group_size)      (same formula and rounding)

with ``silu(g) = g / (1 + exp(-g))`` in fp32, through Triton's ``exp`` and ``/`` (both within a few
fp32 ulps on GPUs: a value near a rounding boundary can take the neighbouring 16-bit number). A
program reads ``BLOCK_ROWS`` rows of one group of gate and up columns and writes only the fp8 values
and their scales: the activated bf16 rows never go to memory. Non-finite values of ``y`` are counted
into ``stats[1]`` as the group quantizer counts its inputs.

Over the fused MoE's sorted rows (``moe.ExpertRuns``: the gate/up product of a grouped GEMM), rows
past the device's row count are left alone and padding rows give ``y = 0``, whatever ``x`` holds
there (those rows of ``x`` are never written), and are not counted.
"""

import torch
import triton
import triton.language as tl

from ..fp8_format import fp8_finite_max
from .quant import (
    GROUP_BLOCK_ROWS,
    QUANT_EPS,
    check_group_format,
    check_rows_limit,
    group_tile,
    store_quantized_groups,
)


@triton.jit
def _silu_mul_group_quant_kernel(
    x_ptr, q_ptr, scale_ptr, stats_ptr, num_rows, half, stride_x, stride_q, stride_s, quant_eps,
    GROUP: tl.constexpr, FP8_MAX: tl.constexpr,
    POW2_SCALE: tl.constexpr, TRACK_STATS: tl.constexpr, BLOCK_ROWS: tl.constexpr,
    rows_limit_ptr=None, pair_ids_ptr=None, num_pairs=0,
):
    if rows_limit_ptr is not None:
        num_rows = tl.minimum(num_rows, tl.load(rows_limit_ptr))
    rows, group, offs, mask = group_tile(num_rows, half, GROUP, BLOCK_ROWS)
    gate_ptrs = x_ptr + rows[:, None] * stride_x + offs[None, :]
    gate = tl.load(gate_ptrs, mask=mask, other=0.0)
    up = tl.load(gate_ptrs + half, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    # the fp32 product of two 16-bit floats is exact: one rounding after it is the 16-bit multiply
    y = (silu * up.to(tl.float32)).to(gate.dtype).to(tl.float32)
    if pair_ids_ptr is not None:  # padding rows: zeros, whatever x holds there
        real = tl.load(pair_ids_ptr + rows, mask=rows < num_rows, other=num_pairs) < num_pairs
        y = tl.where(real[:, None], y, 0.0)
    store_quantized_groups(y, rows, offs, mask, group, num_rows, q_ptr, scale_ptr, stats_ptr, stride_q, stride_s,
                           quant_eps, FP8_MAX, POW2_SCALE, TRACK_STATS)


def silu_mul_group_quant(
    x: torch.Tensor,
    group_size: int = 128,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    pow2_scale: bool = False,
    stats: torch.Tensor | None = None,
    rows_limit: torch.Tensor | None = None,
    pair_ids: tuple[torch.Tensor, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``silu(x[:, :D]) * x[:, D:]`` of ``x [M, 2 * D]`` (bf16/fp16, last dim contiguous),
    quantized per ``group_size`` columns as ``quantize_per_token_group`` does. ``x`` is not
    modified.

    Returns ``(q [M, D] fp8, scales [M, cdiv(D, group_size)] fp32)``. ``stats`` (optional ``[2]``
    int32 guard counters) gets the non-finite activated values in ``stats[1]``. Over the fused
    MoE's sorted rows: ``rows_limit`` (int32 ``[1]`` on x's device) reads and writes only the rows
    before ``rows_limit[0]``, as ``quantize_per_token_group``'s; ``pair_ids = (ids [M] int32,
    num_pairs)`` makes each row whose id is ``num_pairs`` or more a padding row: zeros out (scale
    ``eps / fp8_max``), nothing counted, whatever ``x`` holds there.
    """
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be a [M, 2 * D] tensor with a contiguous last dim, got {tuple(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"x must be bf16 or fp16, got {x.dtype}")
    rows, cols = x.shape
    if cols % 2:
        raise ValueError(f"x must hold gate and up halves of equal width, got {cols} columns")
    check_group_format(group_size, fp8_dtype)
    _check_row_selection(x, rows_limit, pair_ids)
    half = cols // 2
    groups = triton.cdiv(half, group_size)
    q = torch.empty(rows, half, dtype=fp8_dtype, device=x.device)
    scales = torch.empty(rows, groups, dtype=torch.float32, device=x.device)
    if rows and half:
        fp8_max = fp8_finite_max(fp8_dtype)
        block_rows = min(GROUP_BLOCK_ROWS, triton.next_power_of_2(rows))
        _silu_mul_group_quant_kernel[(triton.cdiv(rows, block_rows), groups)](
            x, q, scales, stats if stats is not None else scales, rows, half, x.stride(0), q.stride(0),
            scales.stride(0), QUANT_EPS, GROUP=group_size, FP8_MAX=fp8_max, POW2_SCALE=pow2_scale,
            TRACK_STATS=stats is not None, BLOCK_ROWS=block_rows,
            rows_limit_ptr=rows_limit, pair_ids_ptr=None if pair_ids is None else pair_ids[0],
            num_pairs=0 if pair_ids is None else pair_ids[1],
        )
    return q, scales


def _check_row_selection(x, rows_limit, pair_ids) -> None:
    check_rows_limit(rows_limit, x.device)
    if pair_ids is not None:
        ids, _ = pair_ids
        if ids.dtype != torch.int32 or ids.shape != (x.shape[0],) or ids.device != x.device:
            raise ValueError(f"pair_ids[0] must be int32 [{x.shape[0]}] on {x.device} (a pair id a row), got "
                             f"{ids.dtype} {tuple(ids.shape)} on {ids.device}")
