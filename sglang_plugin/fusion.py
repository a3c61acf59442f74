"""RMSNorm and SiLU-and-mul fused with ``latentspeed_fp8``'s activation quantization in SGLang's
DeepSeek-V2/V3 models (``common_kernels/fp8/norm_quant.py``, ``silu_mul_quant.py``): the producer
writes the fp8 values and their 1 x 128 group scales, and its one consumer, a latentspeed linear
layer, takes them as the ``(fp8, scale)`` tuple that SGLang's ``Fp8LinearMethod.apply`` passes to
``w8a8_block_fp8_linear`` (``sglang_plugin.fp8.block_linear``).

SGLang has no compiler pass to hook, so after the model is loaded (a ``HookRegistry`` hook on
``ModelRunner.load_model``, before CUDA graphs are captured) the chosen producer instances get a
subclass of their class, which keeps their parameters and every reference to them:

- ``input_layernorm`` of each decoder layer, whose output only ``fused_qkv_a_proj_with_mqa`` reads
  (models with ``q_lora_rank``, without the DSA indexer);
- ``self_attn.q_a_layernorm`` (read only by ``q_b_proj``);
- with ``LATENTSPEED_FUSE_SILU_QUANT=1``, the ``act_fn`` of each ``DeepseekV2MLP`` (dense MLPs and
  shared experts), read only by ``down_proj``.

Not fused: ``post_attention_layernorm`` (``DeepseekV2MLP.forward`` reads its output's shape, and a
MoE layer's router reads it too), and nothing at all with tensor, DP-attention or decode-context
parallelism, ``--enable-torch-compile`` (SGLang then runs norms through ``forward_native``) or deterministic
inference. ``LATENTSPEED_FUSE_NORM_QUANT=1`` turns the norm fusion on (default 0 in SGLang until it
has been measured on a GPU; vLLM's default is 1).
"""

import logging

import torch
from sglang.srt.layers.activation import SiluAndMul
from sglang.srt.layers.layernorm import RMSNorm

from common_kernels.fp8 import (
    FUSE_NORM_ENV,
    FUSE_SILU_ENV,
    SCALE_BLOCK,
    fusion_switch,
    rms_norm_group_quant,
    silu_mul_group_quant,
)
from common_kernels.guard import fp8_guard

LOAD_TARGET = "sglang.srt.model_executor.model_runner.ModelRunner.load_model"
NORM_ENV, SILU_ENV = FUSE_NORM_ENV, FUSE_SILU_ENV
logger = logging.getLogger(__name__)


def _fusable(x: torch.Tensor, weight: torch.Tensor | None = None) -> bool:
    """A batch the fused kernels take as SGLang's own kernels would: 2-D, non-empty, bf16."""
    return (x.dim() == 2 and x.shape[0] > 0 and x.dtype == torch.bfloat16
            and (weight is None or weight.dtype == x.dtype))


class FusedRMSNormQuant(RMSNorm):
    """SGLang's ``RMSNorm`` whose output is ``(fp8 values, group scales)``: with a residual,
    ``((q, scales), x + residual)`` (the sum in fp32, rounded to bf16 as the next residual),
    without one ``(q, scales)``. Other batches (empty, not 2-D, not bf16) take the unfused path."""

    def forward(self, x, residual=None, post_residual_addition=None):
        if not _fusable(x, self.weight):
            return super().forward(x, residual, post_residual_addition)
        if residual is not None and post_residual_addition is not None:
            residual = residual + post_residual_addition  # where SGLang's fused_add_rmsnorm adds it
        q, scales, residual_out = rms_norm_group_quant(x, self.weight, self.variance_epsilon, residual,
                                                       SCALE_BLOCK, stats=fp8_guard(x.device).counters)
        return (q, scales) if residual is None else ((q, scales), residual_out)


class FusedSiluMulQuant(SiluAndMul):
    """SGLang's ``SiluAndMul`` whose output is ``(fp8 values, group scales)``."""

    def forward(self, x):
        if not _fusable(x):
            return super().forward(x)
        return silu_mul_group_quant(x, SCALE_BLOCK, stats=fp8_guard(x.device).counters)


def _ours(linear) -> bool:
    """Whether ``linear`` runs ``latentspeed_fp8``'s GEMM (its linear method, or its compressed-tensors
    scheme), which takes a ``(fp8, scale)`` input."""
    from .fp8 import block_linear

    method = getattr(linear, "scheme", None) or getattr(linear, "quant_method", None)
    return getattr(method, "w8a8_block_fp8_linear", None) is block_linear


def _plain_norm(norm) -> bool:
    """An ``RMSNorm`` whose CUDA forward is the plain (fused-add) RMSNorm that the kernel computes."""
    return (type(norm) is RMSNorm and norm.has_weight and not norm.cast_x_before_out_mul and not norm.fp32_residual
            and norm.variance_size_override is None)


def _why_not(runner) -> str | None:
    """Why the fusion stays off for this runner's model, or None."""
    server_args = runner.server_args
    if getattr(server_args, "enable_torch_compile", False):
        return "--enable-torch-compile runs norms through forward_native"
    if (getattr(server_args, "tp_size", 1) != 1 or getattr(server_args, "enable_dp_attention", False)
            or getattr(server_args, "dcp_size", 1) not in (None, 1)):
        return "tensor, DP-attention or decode-context parallelism gathers and reduces the norms' outputs"
    if getattr(server_args, "enable_deterministic_inference", False):
        return "deterministic inference"
    return None


def fuse_producers(model: torch.nn.Module, norm: bool, silu_mul: bool) -> int:
    """Give the fusable producers of ``model``'s DeepSeek-V2/V3 layers their fused subclass;
    returns how many were changed."""
    from sglang.srt.models.deepseek_v2 import DeepseekV2DecoderLayer, DeepseekV2MLP

    changed = 0
    for module in model.modules():
        if norm and isinstance(module, DeepseekV2DecoderLayer):
            attn = module.self_attn
            if getattr(attn, "q_lora_rank", None) is None or getattr(attn, "use_dsa", False):
                continue
            pairs = ((module, "input_layernorm", getattr(attn, "fused_qkv_a_proj_with_mqa", None)),
                     (attn, "q_a_layernorm", getattr(attn, "q_b_proj", None)))
            for owner, name, consumer in pairs:
                producer = getattr(owner, name, None)
                if consumer is not None and _ours(consumer) and _plain_norm(producer):
                    producer.__class__ = FusedRMSNormQuant
                    changed += 1
        if silu_mul and isinstance(module, DeepseekV2MLP) and type(module.act_fn) is SiluAndMul \
                and _ours(module.down_proj) and getattr(module, "swiglu_limit", None) is None:
            module.act_fn.__class__ = FusedSiluMulQuant
            changed += 1
    return changed


def after_load_model(result, runner, *args, **kwargs) -> None:
    """``ModelRunner.load_model`` hook: fuse the producers the switches ask for, where allowed."""
    norm, silu_mul = fusion_switch(NORM_ENV, "0"), fusion_switch(SILU_ENV, "0")  # off in SGLang until measured
    if not (norm or silu_mul):
        return
    reason = _why_not(runner)
    if reason:
        logger.warning("latentspeed: producer + fp8 quantization fusion off: %s", reason)
        return
    changed = fuse_producers(runner.model, norm, silu_mul)
    logger.info("latentspeed: %d producers fused with latentspeed_fp8's activation quantization", changed)
