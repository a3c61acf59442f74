"""FP8 kernels: dynamic per-token-group activation quantization and the block-scaled W8A8 GEMM
(DeepSeek-V3's 128 x 128 / 1 x 128 recipe), each beside its PyTorch reference."""

from .gemm import SCALE_BLOCK, block_scaled_gemm
from .quant import quantize_per_token_group
from .support import is_supported

__all__ = ["SCALE_BLOCK", "block_scaled_gemm", "is_supported", "quantize_per_token_group"]
