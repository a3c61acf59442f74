"""MLA (multi-head latent attention) kernels: paged latent cache write, weight-absorbed
decode and varlen prefill attention, each beside its PyTorch reference in ``reference.py``."""

from ..fp8_format import FP8_DTYPES
from .cache import write_latent_cache
from .decode import DecodePlan, max_workspace_tokens_times_splits, mla_decode, plan_decode, sm90_kernels_apply
from .prefill import split_head_dim, varlen_attention, warm_up_varlen_attention
from .support import is_supported

__all__ = [
    "FP8_DTYPES",
    "DecodePlan",
    "is_supported",
    "max_workspace_tokens_times_splits",
    "mla_decode",
    "plan_decode",
    "sm90_kernels_apply",
    "split_head_dim",
    "varlen_attention",
    "warm_up_varlen_attention",
    "write_latent_cache",
]
