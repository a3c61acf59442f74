"""``--quantization latentspeed_fp8``: DeepSeek-V3's block FP8 (W8A8: E4M3 weights in 128 x 128
blocks with fp32 scales, activations quantized per token and 128 columns at run time, fp32
accumulation) on latentspeed's Triton GEMM (``common_kernels.fp8``).

Checkpoints it loads:

- native DeepSeek-V3 FP8 (``quant_method: fp8``, ``weight_block_size: [128, 128]``,
  ``weight_scale_inv``), claimed from vLLM's ``fp8`` method when the user asks for ours;
- compressed-tensors FP8 block (``float-quantized``, strategy ``block``, ``weight_scale``), as
  llm-compressor writes them, claimed from ``compressed-tensors`` likewise;
- bf16/fp16, quantized to 128 x 128 blocks while loading (latentspeed's quantizer).

vLLM's own classes load and shard the weights; the linear layers' GEMM is ours
(``LatentspeedBlockFp8Kernel``) and so are the routed experts in all three formats
(``common_kernels.fp8.fused_moe_fp8``, behind vLLM's router, shared experts, expert map and
reductions); a mixed compressed-tensors checkpoint's FP4 experts stay vLLM's. KV-cache scales stay
vLLM's too: its kv-cache method loads ``k_scale``/``v_scale``, which latentspeed's attention
backend reads.
Weights keep vLLM's plain ``weight [N, K]`` / ``weight_scale_inv`` layout, so MLA's
``kv_b_proj`` is dequantized exactly for weight absorption.
"""

import torch
from vllm.config import get_current_vllm_config
from vllm.model_executor.kernels.linear.scaled_mm.BlockScaledMMLinearKernel import Fp8BlockScaledMMLinearKernel
from vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel import FP8ScaledMMLinearLayerConfig
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
from vllm.model_executor.layers.linear import LinearBase, register_weight_loader_v2_supported_method
from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
    CompressedTensorsConfig,
    CompressedTensorsLinearMethod,
)
from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
    compressed_tensors_moe_w8a8_fp8 as ct_moe_fp8,
)
from vllm.model_executor.layers.quantization.compressed_tensors.schemes import CompressedTensorsW8A8Fp8
from vllm.model_executor.layers.quantization.fp8 import Fp8Config, Fp8LinearMethod, Fp8MoEMethod
from vllm.model_executor.layers.quantization.online.fp8 import (
    Fp8PerBlockOnlineLinearMethod,
    Fp8PerBlockOnlineMoEMethod,
    _Fp8OnlineLinearBase,
)
from vllm.model_executor.layers.quantization.utils.fp8_utils import (
    create_fp8_scale_parameter,
    create_fp8_weight_parameter,
    validate_fp8_block_shape,
)
from vllm.model_executor.layers.quantization.utils.quant_utils import is_layer_skipped
from vllm.model_executor.parameter import BlockQuantScaleParameter
from vllm.model_executor.utils import replace_parameter
from vllm.utils.torch_utils import direct_register_custom_op

from common_kernels.fp8 import (
    MIN_CAPABILITY,
    SCALE_BLOCK,
    block_fp8_linear,
    check_block_scales,
    check_checkpoint_scheme,
    claims_checkpoint,
    fused_moe_fp8,
    is_supported,
    quantize_expert_weights,
    quantize_linear_weight,
    refuse_mismatched_dtypes,
)
from common_kernels.fp8.warmup import warm_up_linear, warm_up_moe, warm_up_producers, warmup_wanted
from common_kernels.guard import fp8_guard

from . import fusion

NAME = "latentspeed_fp8"
BLOCK = [SCALE_BLOCK, SCALE_BLOCK]


def _name(layer) -> str:
    """How errors name a layer: the method, then vLLM's prefix of the layer."""
    return f"{NAME}: {getattr(layer, 'prefix', None) or getattr(layer, 'layer_name', None) or type(layer).__name__}"


def _block_fp8_linear_fake(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


_LIBRARY = torch.library.Library("latentspeed", "FRAGMENT")  # alive as long as the module
direct_register_custom_op("block_fp8_linear", block_fp8_linear, fake_impl=_block_fp8_linear_fake, target_lib=_LIBRARY)


class LatentspeedBlockFp8Kernel(Fp8BlockScaledMMLinearKernel):
    """vLLM's block-FP8 linear kernel interface, computed by ``torch.ops.latentspeed.block_fp8_linear``
    (which quantizes the activations itself)."""

    apply_input_quant = False

    @classmethod
    def is_supported(cls, compute_capability: int | None = None) -> tuple[bool, str | None]:
        capability = None if compute_capability is None else divmod(compute_capability, 10)
        ok, reason = is_supported(weight_block=BLOCK, activation_group=SCALE_BLOCK, capability=capability)
        return ok, reason or None

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        super().process_weights_after_loading(layer)
        params = self._get_layer_params(layer)
        scale = params.weight_scale if params.weight_scale_inv is None else params.weight_scale_inv
        check_block_scales(_name(layer), params.weight, scale)
        if warmup_wanted(params.weight.device):  # every batch size's kernels, before vLLM's JIT monitor starts
            max_tokens = get_current_vllm_config().scheduler_config.max_num_batched_tokens
            warm_up_linear(params.weight, scale, max_tokens, self.config.input_dtype)
            warm_up_producers(params.weight.shape[1], max_tokens, self.config.input_dtype, params.weight.device,
                              *fusion.fused_producers())

    def apply_block_scaled_mm(self, A, B, As, Bs):
        return torch.ops.latentspeed.block_fp8_linear(A, B, Bs)


def _our_kernel(method, weight_shape) -> LatentspeedBlockFp8Kernel:
    """Our GEMM behind vLLM's kernel interface, built directly: vLLM's kernel chooser would
    pick (and set up) one of its own first. The first one built also installs the RMSNorm +
    quantization fusion pass where asked for (``vllm_plugin/fusion.py``)."""
    fusion.install()
    return LatentspeedBlockFp8Kernel(
        FP8ScaledMMLinearLayerConfig(
            weight_quant_key=method.weight_quant_key,
            activation_quant_key=method.activation_quant_key,
            weight_shape=weight_shape,
            input_dtype=method.input_dtype,
            out_dtype=method.out_dtype,
        )
    )


@register_weight_loader_v2_supported_method
class LatentspeedFp8LinearMethod(Fp8LinearMethod):
    """Serialized block-FP8 linear layers on latentspeed's GEMM: the weight ``[N, K]`` E4M3 and
    its fp32 scales ``[N/128, K/128]`` under ``scale_name`` (``weight_scale_inv`` in DeepSeek-V3
    checkpoints, ``weight_scale`` in compressed-tensors ones), sharded by vLLM's loaders."""

    def __init__(self, quant_config: Fp8Config, scale_name: str = "weight_scale_inv"):
        super().__init__(quant_config)
        self.scale_name = scale_name
        self.use_deep_gemm = False  # no UE8M0 requantization; MLA dequantizes kv_b_proj exactly

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                       params_dtype, **extra_weight_attrs):
        weight_loader = extra_weight_attrs.get("weight_loader")
        layer.logical_widths = output_partition_sizes
        layer.input_size_per_partition = input_size_per_partition
        layer.output_size_per_partition = sum(output_partition_sizes)
        layer.orig_dtype = params_dtype
        layer.weight_block_size = BLOCK
        validate_fp8_block_shape(layer, input_size, output_size, input_size_per_partition, output_partition_sizes,
                                 BLOCK)
        weight = create_fp8_weight_parameter(layer.output_size_per_partition, input_size_per_partition, weight_loader)
        layer.register_parameter("weight", weight)
        scale = create_fp8_scale_parameter(BlockQuantScaleParameter, output_partition_sizes, input_size_per_partition,
                                           BLOCK, weight_loader)
        layer.register_parameter(self.scale_name, scale)
        refuse_mismatched_dtypes(lambda: _name(layer), weight, scale)
        self.fp8_linear = _our_kernel(self, weight.shape)
        self.use_marlin = False


class LatentspeedOnlineFp8LinearMethod(Fp8PerBlockOnlineLinearMethod):
    """bf16/fp16 linear layers quantized to 128 x 128 blocks as soon as vLLM's online loading has
    all their shards, by latentspeed's quantizer (as in SGLang; non-finite weights are refused),
    on latentspeed's GEMM."""

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                       params_dtype, **extra_weight_attrs):
        _Fp8OnlineLinearBase.create_weights(self, layer, input_size_per_partition, output_partition_sizes,
                                            input_size, output_size, params_dtype, **extra_weight_attrs)
        layer.weight_block_size = self.weight_block_size
        self.fp8_linear = _our_kernel(self, layer.weight.shape)

    def process_weights_after_loading(self, layer) -> None:
        if getattr(layer, "_already_called_process_weights_after_loading", False):  # vLLM's reload guard
            return
        layer.input_scale = None
        weight, scale = quantize_linear_weight(_name(layer), layer.weight)
        replace_parameter(layer, "weight", weight)
        replace_parameter(layer, "weight_scale_inv", scale)
        self.fp8_linear.process_weights_after_loading(layer)
        # DeepSeek-V3's fused_qkv_a_proj chose vLLM's bf16-only small-batch GEMM when it was built
        # (its weight was bf16 then): that GEMM would now be handed our fp8 weight.
        if getattr(layer, "_use_min_latency_gemm", False):
            layer._use_min_latency_gemm = False
        layer._already_called_process_weights_after_loading = True


class _LatentspeedMoE:
    """vLLM's block-FP8 MoE method with the routed experts computed by ``fused_moe_fp8``: vLLM
    loads (and, for bf16 checkpoints, quantizes) the experts, routes, runs the shared experts,
    applies ``routed_scaling_factor`` and reduces; ``apply`` returns the routed sum only. The
    block scales keep the checkpoint's name, ``w13_`` / ``w2_`` + ``weight_scale_name``."""

    @property
    def is_monolithic(self) -> bool:  # vLLM routes, then calls apply
        return False

    def maybe_make_prepare_finalize(self, routing_tables=None):
        return None  # vLLM's own dispatch and combine around apply

    def create_weights(self, layer, *args, **kwargs):
        super().create_weights(layer, *args, **kwargs)
        for w in ("w13", "w2"):
            refuse_mismatched_dtypes(lambda w=w: f"{_name(layer)} {w}", getattr(layer, f"{w}_weight"),
                                     getattr(layer, f"{w}_{self.weight_scale_name}", None))

    def _setup_kernel(self, layer, w13, w2, w13_scale, w2_scale, w13_input_scale, w2_input_scale) -> None:
        name = _name(layer)
        unsupported = {
            "an activation other than SiLU": layer.activation != MoEActivation.SILU,
            "expert biases": self.moe.has_bias,
            "clamped SwiGLU": any(getattr(layer, f"swiglu_{k}", None) is not None for k in ("limit", "alpha", "beta")),
            "routing weights applied to the input": layer.apply_router_weight_on_input,
            "static activation scales": w13_input_scale is not None or w2_input_scale is not None,
        }
        for what, present in unsupported.items():
            if present:
                raise ValueError(f"{name}: {what} is not supported by latentspeed's fused MoE")
        for w, (weights, scales) in {"w13": (w13, w13_scale), "w2": (w2, w2_scale)}.items():
            for e in range(weights.shape[0]):
                check_block_scales(f"{name} {w}[{e}]", weights[e], scales[e])
        replace_parameter(layer, "w13_weight", w13)
        replace_parameter(layer, "w2_weight", w2)
        replace_parameter(layer, f"w13_{self.weight_scale_name}", w13_scale)
        replace_parameter(layer, f"w2_{self.weight_scale_name}", w2_scale)
        self.moe_quant_config = self.get_fused_moe_quant_config(layer)
        self.moe_kernel = None
        warm_up_moe(w13, w13_scale, w2, w2_scale, self.moe.experts_per_token, self.moe.max_num_tokens,
                    self.moe.in_dtype, layer.expert_map)

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input):
        w13_scale, w2_scale = (getattr(layer, f"{w}_{self.weight_scale_name}") for w in ("w13", "w2"))
        return fused_moe_fp8(x, layer.w13_weight, w13_scale, layer.w2_weight, w2_scale, topk_weights, topk_ids,
                             stats=fp8_guard(x.device).counters, expert_map=layer.expert_map, check_ids=False)


class LatentspeedFp8MoEMethod(_LatentspeedMoE, Fp8MoEMethod):
    """Serialized block-FP8 experts (``w13_weight_scale_inv`` / ``w2_weight_scale_inv``)."""


class LatentspeedOnlineFp8MoEMethod(_LatentspeedMoE, Fp8PerBlockOnlineMoEMethod):
    """bf16/fp16 experts quantized to 128 x 128 blocks once vLLM's online loading has them all, by latentspeed's
    quantizer, as the linear layers are: non-finite weights are refused. vLLM's own quantizer is a
    ``torch.compile``d function. It ran just before the MoE's warm-up, which found ``TRITON_CACHE_DIR`` set to
    Inductor's folder and, unlike the linears', took nearly as long at the next start
    (``benchmarks/results/vllm-moe-warmup-h100-2026-12-06-s46.md``); with ours it loads every kernel from Triton's
    disk cache there (``vllm-moe-warmup-h100-2026-12-06-s47.md``)."""

    def process_weights_after_loading(self, layer) -> None:
        if getattr(layer, "_already_called_process_weights_after_loading", False):  # vLLM's reload guard
            return
        self._zero_padding(layer)
        name = _name(layer)
        (w13, w13_scale), (w2, w2_scale) = (quantize_expert_weights(f"{name} {w}", getattr(layer, f"{w}_weight"))
                                            for w in ("w13", "w2"))
        layer.weight_block_size = self.weight_block_size
        self._setup_kernel(layer, w13, w2, w13_scale, w2_scale, layer.w13_input_scale, layer.w2_input_scale)
        layer._already_called_process_weights_after_loading = True


class LatentspeedCTFp8MoEMethod(_LatentspeedMoE, ct_moe_fp8.CompressedTensorsW8A8Fp8MoEMethod):
    """compressed-tensors FP8 block experts (``w13_weight_scale`` / ``w2_weight_scale``)."""

    weight_scale_name = "weight_scale"

    def process_weights_after_loading(self, layer) -> None:
        self._setup_kernel(layer, layer.w13_weight, layer.w2_weight, layer.w13_weight_scale, layer.w2_weight_scale,
                           layer.w13_input_scale, layer.w2_input_scale)


class LatentspeedCTConfig(CompressedTensorsConfig):
    """compressed-tensors checkpoints under ``--quantization latentspeed_fp8``: vLLM's loader and
    scheme selection (ignore lists, KV-cache scales), with the FP8 block linear layers on
    latentspeed's GEMM and the FP8 block experts on its fused MoE."""

    def get_name(self) -> str:
        return NAME

    def get_quant_method(self, layer, prefix):
        method = super().get_quant_method(layer, prefix)
        if isinstance(layer, RoutedExperts):
            return self._moe_method(method, layer, prefix)
        scheme = getattr(layer, "scheme", None)
        if type(method) is not CompressedTensorsLinearMethod:
            return method
        if not isinstance(scheme, CompressedTensorsW8A8Fp8) or scheme.weight_block_size is None:
            how = "FP8 per tensor or channel" if isinstance(scheme, CompressedTensorsW8A8Fp8) else type(scheme).__name__
            raise ValueError(f"{NAME}: {prefix} is quantized as {how} in this checkpoint; "
                             "only FP8 in 128 x 128 blocks is supported")
        check_checkpoint_scheme(f"{NAME}: {prefix}", True, "static" if scheme.is_static_input_scheme else "dynamic",
                                scheme.weight_block_size)
        block_config = LatentspeedFp8Config(is_checkpoint_fp8_serialized=True, weight_block_size=BLOCK)
        return LatentspeedFp8LinearMethod(block_config, scale_name="weight_scale")

    @staticmethod
    def _moe_method(method, layer, prefix):
        """FP8 block experts on latentspeed's fused MoE; FP8 per tensor or channel refused, as for
        linear layers; other schemes (a mixed checkpoint's FP4 experts) and ignored layers stay vLLM's."""
        if type(method) is not ct_moe_fp8.CompressedTensorsW8A8Fp8MoEMethod:
            return method
        if not method.block_quant:
            raise ValueError(f"{NAME}: the experts of {prefix} are quantized as FP8 per tensor or channel in this "
                             "checkpoint; only FP8 in 128 x 128 blocks is supported")
        check_checkpoint_scheme(f"{NAME}: {prefix}", True, "dynamic" if method.input_quant.dynamic else "static",
                                method.weight_block_size)
        return LatentspeedCTFp8MoEMethod(method.weight_quant, method.input_quant, layer.moe_config)


class LatentspeedFp8Config(Fp8Config):
    """The ``latentspeed_fp8`` quantization method (module docstring). Built with no arguments
    (vLLM's way for a checkpoint without a quantization config) it quantizes while loading."""

    def __init__(self, is_checkpoint_fp8_serialized=False, activation_scheme="dynamic", ignored_layers=None,
                 weight_block_size=None, store_dtype=None):
        check_checkpoint_scheme(NAME, is_checkpoint_fp8_serialized, activation_scheme, weight_block_size)
        if store_dtype is not None:
            raise ValueError(f"{NAME}: store_dtype {store_dtype!r} is not supported")
        super().__init__(is_checkpoint_fp8_serialized, activation_scheme, ignored_layers,
                         weight_block_size if is_checkpoint_fp8_serialized else None)

    @classmethod
    def get_name(cls) -> str:
        return NAME

    @classmethod
    def get_min_capability(cls) -> int:
        return MIN_CAPABILITY[0] * 10 + MIN_CAPABILITY[1]

    @classmethod
    def from_config(cls, config: dict):
        if config.get("quant_method") == "compressed-tensors":
            return LatentspeedCTConfig.from_config(config)
        return super().from_config(config)

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None):
        return NAME if claims_checkpoint(hf_quant_cfg, user_quant, NAME) else None

    def get_quant_method(self, layer, prefix):
        if isinstance(layer, LinearBase) and not self._skipped(prefix):
            if self.is_checkpoint_fp8_serialized:
                return LatentspeedFp8LinearMethod(self)
            return LatentspeedOnlineFp8LinearMethod()
        if isinstance(layer, RoutedExperts) and not self._skipped(prefix):
            if self.is_checkpoint_fp8_serialized:
                return LatentspeedFp8MoEMethod(self, layer)
            return LatentspeedOnlineFp8MoEMethod(layer=layer)
        return super().get_quant_method(layer, prefix)

    def _skipped(self, prefix: str) -> bool:
        return is_layer_skipped(prefix, self.ignored_layers, self.packed_modules_mapping)
