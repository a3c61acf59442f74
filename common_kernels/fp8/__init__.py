"""FP8 kernels: dynamic per-token-group and per-token activation quantization, the block-scaled W8A8
GEMM (DeepSeek-V3's 128 x 128 / 1 x 128 recipe), RMSNorm and SiLU-and-mul each fused with the group
quantization, and the block-FP8 fused MoE, each beside its PyTorch reference, and the block-FP8
linear forward the engine adapters share."""

from .gemm import SCALE_BLOCK, block_scaled_gemm
from .linear import (
    block_fp8_linear,
    check_block_scales,
    quantize_expert_weights,
    quantize_linear_weight,
    refuse_mismatched_dtypes,
)
from .moe import append_shared_experts, fused_moe_fp8
from .norm_quant import rms_norm_group_quant
from .quant import quantize_per_token, quantize_per_token_group, quantize_weight_blocks
from .silu_mul_quant import silu_mul_group_quant
from .support import (
    FUSE_NORM_ENV,
    FUSE_SILU_ENV,
    MIN_CAPABILITY,
    check_checkpoint_scheme,
    claims_checkpoint,
    fusion_switch,
    is_supported,
)

__all__ = [
    "FUSE_NORM_ENV",
    "FUSE_SILU_ENV",
    "MIN_CAPABILITY",
    "SCALE_BLOCK",
    "append_shared_experts",
    "block_fp8_linear",
    "block_scaled_gemm",
    "check_checkpoint_scheme",
    "check_block_scales",
    "claims_checkpoint",
    "fused_moe_fp8",
    "fusion_switch",
    "is_supported",
    "quantize_expert_weights",
    "quantize_linear_weight",
    "quantize_per_token",
    "quantize_per_token_group",
    "quantize_weight_blocks",
    "refuse_mismatched_dtypes",
    "rms_norm_group_quant",
    "silu_mul_group_quant",
]
