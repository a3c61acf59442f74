"""Block-scaled fp8 GEMM, W8A8 (DeepSeek-V3's recipe: 128 x 128 weight blocks, 1 x 128 activation groups).

    C[m, n] = sum over K blocks kb of  a_scale[m, kb] * b_scale[n // 128, kb] * sum_{k in kb} A[m, k] B[n, k]

``A [M, K]`` fp8 activations with ``a_scale [M, cdiv(K, 128)]`` (``quantize_per_token_group``),
``B [N, K]`` fp8 weights (the ``nn.Linear`` layout) with ``b_scale [cdiv(N, 128), cdiv(K, 128)]``
(DeepSeek-V3's ``weight_scale_inv``). Each 128-wide K block is one fp8 tensor-core dot into an fp32
partial that is scaled before it joins the fp32 accumulator, so no scale ever multiplies an fp8
value. Output ``C [M, N]`` bf16 (or fp16). K need not be a multiple of 128: the last block is
masked. The recipe: DeepSeek-V3 report (arXiv:2412.19437), section 3.3.
"""

import os

import torch
import triton
import triton.language as tl

from ..fp8_format import FP8_DTYPES

SCALE_BLOCK = 128

_GEMM_CONFIGS = (
    [triton.Config({"BLOCK_M": 16, "BLOCK_N": 32}, num_warps=4, num_stages=1)]
    if os.environ.get("TRITON_INTERPRET") == "1"
    else [
        # Small M (decode) wants narrow M tiles and wide N; large M, square tiles.
        triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=st)
        for m, n, w, st in ((16, 64, 4, 4), (32, 128, 4, 4), (64, 128, 4, 3), (128, 128, 8, 3))
    ]
)


@triton.autotune(configs=_GEMM_CONFIGS, key=["M_BUCKET", "N", "K"])
@triton.jit
def _block_scaled_gemm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    a_scale_ptr,
    b_scale_ptr,
    M,
    N,
    K,
    stride_am,
    stride_bn,
    stride_cm,
    stride_asm,
    stride_bsn,
    M_BUCKET: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    a_rows = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am
    b_rows = b_ptr + offs_n.to(tl.int64)[:, None] * stride_bn
    a_scales = a_scale_ptr + offs_m.to(tl.int64) * stride_asm  # [BLOCK_M]
    b_scales = b_scale_ptr + (offs_n // BLOCK_K).to(tl.int64) * stride_bsn  # [BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        mask_k = kb * BLOCK_K + offs_k < K
        a = tl.load(a_rows + kb * BLOCK_K + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(b_rows + kb * BLOCK_K + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        a_s = tl.load(a_scales + kb, mask=mask_m, other=0.0)
        b_s = tl.load(b_scales + kb, mask=mask_n, other=0.0)
        acc += tl.dot(a, tl.trans(b)) * a_s[:, None] * b_s[None, :]  # [BLOCK_M, BLOCK_N]
    c = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def block_scaled_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``C = (A * a_scale) @ (B * b_scale).T`` with the scales applied per 128-wide K block.

    Args:
        a: ``[M, K]`` fp8 (E4M3 or E5M2), last dim contiguous.
        a_scale: ``[M, cdiv(K, 128)]`` fp32, one scale per row and K block.
        b: ``[N, K]`` fp8, last dim contiguous (an ``nn.Linear`` weight).
        b_scale: ``[cdiv(N, 128), cdiv(K, 128)]`` fp32, one scale per 128 x 128 block.
        out_dtype: bf16 or fp16. ``out``: optional ``[M, N]`` buffer, last dim contiguous.

    Returns ``C [M, N]``. Raises ``ValueError`` naming any shape, dtype or layout mismatch.
    """
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"a [M, K] and b [N, K] must share K, got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.dtype not in FP8_DTYPES or b.dtype not in FP8_DTYPES:
        raise ValueError(f"a and b must be fp8, got {a.dtype} and {b.dtype}")
    (m, k), n = a.shape, b.shape[0]
    k_blocks, n_blocks = triton.cdiv(k, SCALE_BLOCK), triton.cdiv(n, SCALE_BLOCK)
    if a_scale.shape != (m, k_blocks) or a_scale.dtype != torch.float32:
        raise ValueError(f"a_scale must be fp32 [{m}, {k_blocks}], got {a_scale.dtype} {tuple(a_scale.shape)}")
    if b_scale.shape != (n_blocks, k_blocks) or b_scale.dtype != torch.float32:
        raise ValueError(f"b_scale must be fp32 [{n_blocks}, {k_blocks}] (128 x 128 blocks), got {b_scale.dtype} {tuple(b_scale.shape)}")
    if a.stride(-1) != 1 or b.stride(-1) != 1 or a_scale.stride(-1) != 1 or b_scale.stride(-1) != 1:
        raise ValueError("a, b and their scales need a contiguous last dimension")
    if out_dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"out_dtype {out_dtype} is not supported: bf16 or fp16 is")
    if out is None:
        out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if m and n:

        def grid(meta):
            return triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n, meta["BLOCK_N"])

        _block_scaled_gemm_kernel[grid](
            a, b, out, a_scale, b_scale, m, n, k, a.stride(0), b.stride(0), out.stride(0),
            a_scale.stride(0), b_scale.stride(0), M_BUCKET=triton.next_power_of_2(m), BLOCK_K=SCALE_BLOCK,
        )
    return out
