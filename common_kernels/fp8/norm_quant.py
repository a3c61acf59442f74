"""RMSNorm fused with the per-token-group fp8 quantization of its output (the producer of most
block-FP8 linear inputs in DeepSeek-V3: the attention's ``fused_qkv_a_proj`` after
``input_layernorm``, ``q_b_proj`` after ``q_a_layernorm``).

For row ``m`` of ``x [M, K]`` (and, with a residual, ``z = x + residual`` first, in fp32, whose
rounding to x's dtype is the new residual)::

    y[m] = dtype(dtype(z[m] * rsqrt(mean(z[m]^2) + eps)) * weight)      (vLLM's RMSNorm, rounded as it is)
    q, s = quantize_per_token_group(y, group_size)                      (same formula and rounding)

One program per row reads the row once and writes only the fp8 values and scales: the
normalized bf16 row never goes to memory. Non-finite values of ``y`` are counted into
``stats[1]`` as the group quantizer counts its inputs.
"""

import torch
import triton
import triton.language as tl

from ..fp8_format import fp8_finite_max
from .quant import QUANT_EPS, add_nonfinite, check_group_format, quantize_groups

MAX_COLS = 16384  # a row is one program's registers: DeepSeek-V3's 7168 and its 1536-wide q_a_layernorm fit


@triton.jit
def _rms_norm_group_quant_kernel(
    x_ptr, residual_ptr, residual_out_ptr, weight_ptr, q_ptr, scale_ptr, stats_ptr,
    num_cols, stride_x, stride_r, stride_ro, stride_q, stride_s, eps, quant_eps,
    HAS_RESIDUAL: tl.constexpr, GROUP: tl.constexpr, NUM_GROUPS: tl.constexpr, FP8_MAX: tl.constexpr,
    POW2_SCALE: tl.constexpr, TRACK_STATS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    # the row as [NUM_GROUPS, GROUP] from the start: a 1-D row reshaped into groups takes a layout
    # whose neighbouring threads are a group apart, and its loads are scalar and uncoalesced
    group = tl.arange(0, NUM_GROUPS)[:, None]
    offs = group * GROUP + tl.arange(0, GROUP)[None, :]
    mask = offs < num_cols
    z = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        z += tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(residual_out_ptr + row * stride_ro + offs, z.to(residual_out_ptr.dtype.element_ty), mask=mask)
    inv_rms = 1.0 / tl.sqrt_rn(tl.sum(tl.sum(z * z, 1), 0) / num_cols + eps)
    weight = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    # dtype(dtype(n) * w): the fp32 product of two 16-bit floats is exact, so one rounding after it
    # is the 16-bit multiply's result
    n = (z * inv_rms).to(weight.dtype).to(tl.float32)
    y = (n * weight.to(tl.float32)).to(weight.dtype).to(tl.float32)
    values, scale = quantize_groups(y, quant_eps, FP8_MAX, POW2_SCALE)
    tl.store(q_ptr + row * stride_q + offs, values.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row * stride_s + group, scale, mask=group * GROUP < num_cols)
    if TRACK_STATS:
        add_nonfinite(stats_ptr, y, mask)


def _num_warps(rows: int, lanes: int) -> int:
    """Up to 128 rows (a decode batch) latency rules: 4 values a thread, at most 16 warps. Above
    it, 16 values a thread, at most 8 warps. On the H200 (``fp8-producers-2026-12-02.md``): at 128
    rows 16 warps beat 8 and 4 by 8-21 % (7168- and 1536-wide rows); at 4096-16384 rows 8 warps
    beat 16 by 5-9 % on 7168-wide rows, and 4 beat 8 and 16 on 1536-wide ones."""
    if rows <= 128:
        return min(16, max(1, lanes // 128))
    return min(8, max(1, lanes // 512))


def rms_norm_group_quant(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    group_size: int = 128,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    pow2_scale: bool = False,
    stats: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """RMSNorm of each row of ``x [M, K]`` (bf16/fp16, ``K <= MAX_COLS``), or of ``x + residual``
    (summed in fp32), with ``weight [K]`` of x's dtype, quantized per ``group_size`` columns as
    ``quantize_per_token_group`` does. Inputs are not modified.

    Returns ``(q [M, K] fp8, scales [M, cdiv(K, group_size)] fp32, residual_out)``: with a
    residual, ``residual_out [M, K]`` is the sum in x's dtype (the next residual), else None.
    ``stats`` (optional ``[2]`` int32 guard counters) gets the non-finite normalized values in
    ``stats[1]``.
    """
    for name, t in (("x", x), ("residual", residual)):
        if t is not None and (t.dim() != 2 or t.stride(-1) != 1):
            raise ValueError(f"{name} must be a [M, K] tensor with a contiguous last dim, got {tuple(t.shape)}")
    rows, cols = x.shape
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual must match x ({tuple(x.shape)}, {x.dtype}), "
                         f"got {tuple(residual.shape)}, {residual.dtype}")
    if weight.shape != (cols,) or weight.dtype != x.dtype:
        raise ValueError(f"weight must be [{cols}] in {x.dtype} (x's dtype), got {tuple(weight.shape)}, {weight.dtype}")
    if cols > MAX_COLS:
        raise ValueError(f"rows of {cols} values are not supported: at most {MAX_COLS}")
    check_group_format(group_size, fp8_dtype)
    groups = triton.cdiv(cols, group_size)
    q = torch.empty(rows, cols, dtype=fp8_dtype, device=x.device)
    scales = torch.empty(rows, groups, dtype=torch.float32, device=x.device)
    residual_out = torch.empty_like(x) if residual is not None else None
    if rows and cols:
        fp8_max = fp8_finite_max(fp8_dtype)
        num_groups = triton.next_power_of_2(groups)
        _rms_norm_group_quant_kernel[(rows,)](
            x, residual if residual is not None else x, residual_out if residual is not None else x,
            weight.contiguous(), q, scales, stats if stats is not None else scales, cols, x.stride(0),
            residual.stride(0) if residual is not None else 0, residual_out.stride(0) if residual is not None else 0,
            q.stride(0), scales.stride(0), eps, QUANT_EPS, HAS_RESIDUAL=residual is not None, GROUP=group_size,
            NUM_GROUPS=num_groups, FP8_MAX=fp8_max, POW2_SCALE=pow2_scale,
            TRACK_STATS=stats is not None, num_warps=_num_warps(rows, num_groups * group_size),
        )
    return q, scales, residual_out

