"""Which fp8 GEMM configurations the kernels cover; engine adapters ask here."""

import os

import torch

from ..fp8_format import FP8_DTYPES
from .gemm import SCALE_BLOCK

MIN_CAPABILITY = (8, 9)  # fp8 tensor-core dots
# Producers fused with the activation quantization (each engine adapter has its own default)
FUSE_NORM_ENV, FUSE_SILU_ENV = "LATENTSPEED_FUSE_NORM_QUANT", "LATENTSPEED_FUSE_SILU_QUANT"


def fusion_switch(name: str, default: str) -> bool:
    """Whether the environment switch ``name`` (``1`` or ``0``; unset: ``default``) turns a producer
    fusion on; any other value raises ``ValueError`` naming it."""
    setting = os.environ.get(name, default)
    if setting not in ("0", "1"):
        raise ValueError(f"{name}={setting!r}: use 1 (fuse) or 0 (do not); the default here is {default}")
    return setting == "1"
CLAIMED_QUANT_METHODS = ("fp8", "compressed-tensors")  # checkpoint formats the FP8 method loads


def claims_checkpoint(hf_quant_cfg, user_quant: str | None, method: str) -> bool:
    """Whether ``method`` takes over a checkpoint's quantization config: only when the user asked
    for it (``--quantization method``) and the checkpoint is in a format it loads."""
    return user_quant == method and isinstance(hf_quant_cfg, dict) and hf_quant_cfg.get("quant_method") in \
        CLAIMED_QUANT_METHODS


def is_supported(
    *, weight_block: tuple[int, int], activation_group: int, fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    capability: tuple[int, int] | None = None,
) -> tuple[bool, str]:
    """``(True, "")`` when the block-scaled GEMM covers this scheme, else ``(False, reason)``."""
    if tuple(weight_block) != (SCALE_BLOCK, SCALE_BLOCK):
        return False, f"weight block {list(weight_block)} is not supported: [{SCALE_BLOCK}, {SCALE_BLOCK}] is"
    if activation_group != SCALE_BLOCK:
        return False, f"activation group {activation_group} is not supported: {SCALE_BLOCK} is"
    if fp8_dtype not in FP8_DTYPES:
        return False, f"{fp8_dtype} is not an fp8 dtype"
    if capability is not None and tuple(capability) < MIN_CAPABILITY:
        return False, f"fp8 GEMMs need compute capability 8.9 or newer (this GPU has {capability[0]}.{capability[1]})"
    return True, ""


def check_checkpoint_scheme(method: str, serialized: bool, activation_scheme: str, weight_block) -> None:
    """Raise ``ValueError`` (prefixed with ``method``) unless a checkpoint's FP8 scheme is what the
    kernels run: dynamic activations and, for FP8-serialized weights, 128 x 128 blocks."""
    if activation_scheme != "dynamic":
        raise ValueError(f"{method}: activation_scheme {activation_scheme!r} is not supported: activations are "
                         "quantized dynamically per token and 128 columns")
    if not serialized:
        return
    if weight_block is None:
        raise ValueError(f"{method}: this FP8 checkpoint is per-tensor (no weight_block_size); only block "
                         "(128 x 128) FP8 is supported")
    ok, reason = is_supported(weight_block=tuple(weight_block), activation_group=SCALE_BLOCK)
    if not ok:
        raise ValueError(f"{method}: this checkpoint's {reason}")
