"""``--quantization latentspeed_fp8`` in SGLang: DeepSeek-V3's block FP8 (W8A8, 128 x 128 weight
blocks, activations quantized per token and 128 columns at run time) with the linear layers'
GEMM from ``common_kernels.fp8`` -- the same method name and math as in vLLM.

Checkpoints: native DeepSeek-V3 FP8 (``weight_scale_inv``) and compressed-tensors FP8 block
(``weight_scale``), claimed when the user asks for this method; bf16 checkpoints, whose linear
layers and routed experts are quantized to 128 x 128 blocks after loading. SGLang's classes load
the weights and route; the linear GEMM (``w8a8_block_fp8_linear`` swapped) and the routed experts
(``common_kernels.fp8.fused_moe_fp8``) are latentspeed's in all three formats; a mixed
compressed-tensors checkpoint's FP4 experts stay SGLang's. DeepSeek's ``kv_b_proj`` is dequantized
for weight absorption from the checkpoint's scales, as with SGLang's ``fp8``.
"""

import torch
from sglang.srt.layers.moe.utils import get_moe_a2a_backend, get_moe_runner_backend
from sglang.srt.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig
from sglang.srt.layers.quantization.compressed_tensors.schemes import (
    CompressedTensorsW8A8Fp8,
    CompressedTensorsW8A8Fp8MoE,
)
from sglang.srt.layers.quantization.fp8 import Fp8Config, Fp8LinearMethod, Fp8MoEMethod

from common_kernels.fp8 import (
    MIN_CAPABILITY,
    SCALE_BLOCK,
    block_fp8_linear,
    block_scaled_gemm,
    check_block_scales,
    check_checkpoint_scheme,
    claims_checkpoint,
    fused_moe_fp8,
    quantize_expert_weights,
    quantize_linear_weight,
    refuse_mismatched_dtypes,
)
from common_kernels.fp8.warmup import warm_up_linear, warm_up_moe, warmup_wanted
from common_kernels.guard import fp8_guard

NAME = "latentspeed_fp8"
BLOCK = [SCALE_BLOCK, SCALE_BLOCK]


def _name(layer) -> str:
    """How errors name a layer: the method, then the layer's prefix (``_remember_prefix``)."""
    return f"{NAME}: {getattr(layer, 'prefix', None) or type(layer).__name__}"


def _remember_prefix(layer, prefix: str) -> None:
    """Most of SGLang's layers do not keep their prefix; errors about their checkpoint tensors need it."""
    if prefix and not getattr(layer, "prefix", None):
        layer.prefix = prefix


def _refuse_mismatched_expert_dtypes(layer, scale_name: str) -> None:
    for w in ("w13", "w2"):
        refuse_mismatched_dtypes(lambda w=w: f"{_name(layer)} {w}", getattr(layer, f"{w}_weight"),
                                 getattr(layer, f"{w}_{scale_name}", None))


def _max_tokens() -> int:
    """The most tokens one forward pass hands a layer: a prefill chunk, or a whole prefill batch
    where chunking is off."""
    from sglang.srt.server_args import get_global_server_args

    args = get_global_server_args()
    return args.chunked_prefill_size if (args.chunked_prefill_size or 0) > 0 else args.max_prefill_tokens


def _warm_up_linear(weight: torch.Tensor, scale: torch.Tensor) -> None:
    """Compile the layer's kernels for every batch size now (``common_kernels.fp8.warmup``); SGLang
    loads under the model's dtype as torch's default, the activations' dtype."""
    if warmup_wanted(weight.device):
        warm_up_linear(weight, scale, _max_tokens(), torch.get_default_dtype())


def _warm_up_experts(layer, scale_name: str, id_map: torch.Tensor | None) -> None:
    if warmup_wanted(layer.w13_weight.device):
        warm_up_moe(layer.w13_weight, getattr(layer, f"w13_{scale_name}"), layer.w2_weight,
                    getattr(layer, f"w2_{scale_name}"), layer.top_k, _max_tokens(), torch.get_default_dtype(),
                    id_map)


def block_linear(input, weight, block_size, weight_scale, input_scale=None, bias=None):
    """SGLang's ``w8a8_block_fp8_linear`` signature over latentspeed's GEMM. A fused producer's
    output (``sglang_plugin.fusion``) arrives already fp8 with its 1 x 128 group scales, as
    ``input_scale`` (``Fp8LinearMethod``) or as an ``(fp8, scale)`` ``input`` (the compressed-tensors
    scheme passes the input as it came); the output is then bf16."""
    if list(block_size) != BLOCK:
        raise ValueError(f"{NAME}: needs 128 x 128 weight blocks, got {list(block_size)}")
    if isinstance(input, tuple):
        input, input_scale = input
    if input_scale is not None:
        out = block_scaled_gemm(input, input_scale, weight, weight_scale.float(), out_dtype=torch.bfloat16)
        return out + bias if bias is not None else out
    out = block_fp8_linear(input.reshape(-1, input.shape[-1]), weight, weight_scale)
    if bias is not None:
        out = out + bias
    return out.view(*input.shape[:-1], weight.shape[0])


class LatentspeedFp8LinearMethod(Fp8LinearMethod):
    """SGLang's FP8 linear method with latentspeed's block GEMM; bf16 weights are quantized to
    128 x 128 blocks once loaded."""

    def __init__(self, quant_config: Fp8Config):
        super().__init__(quant_config)
        self.use_marlin = False
        self.w8a8_block_fp8_linear = block_linear

    def create_weights(self, layer, *args, **kwargs):
        super().create_weights(layer, *args, **kwargs)
        refuse_mismatched_dtypes(lambda: _name(layer), layer.weight, getattr(layer, "weight_scale_inv", None))

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        name = _name(layer)
        if not self.block_quant:  # a bf16 checkpoint
            weight, scale = quantize_linear_weight(name, layer.weight.data)
            layer.weight = torch.nn.Parameter(weight, requires_grad=False)
            layer.weight_scale_inv = torch.nn.Parameter(scale, requires_grad=False)
            self.block_quant, self.weight_block_size = True, BLOCK
        else:
            check_block_scales(name, layer.weight, layer.weight_scale_inv)
            super().process_weights_after_loading(layer)
        _warm_up_linear(layer.weight, layer.weight_scale_inv)


def _require_triton_runner(what_else_ok: bool = True) -> None:
    backend, a2a = get_moe_runner_backend(), get_moe_a2a_backend()
    if not (backend.is_auto() or backend.is_triton()) or not a2a.is_none() or not what_else_ok:
        raise ValueError(f"{NAME}: latentspeed's fused MoE needs --moe-runner-backend auto or triton, "
                         "--moe-a2a-backend none and FP8 (not MXFP8/FP4) experts")


def _check_runner_config(layer, config) -> None:
    unsupported = {
        "an activation other than SiLU": config.activation != "silu" or not config.is_gated,
        "routing weights applied to the input": config.apply_router_weight_on_input,
        "clamped or scaled SwiGLU": any(getattr(config, f, None) is not None
                                        for f in ("gemm1_alpha", "gemm1_clamp_limit", "swiglu_limit")),
        "expert biases": getattr(layer, "with_bias", False),
        "no_combine": config.no_combine,
    }
    for what, present in unsupported.items():
        if present:
            raise ValueError(f"{NAME}: {getattr(layer, 'prefix', 'MoE layer')}: {what} is not supported by "
                             "latentspeed's fused MoE")


def _check_expert_scales(layer, scale_name: str) -> None:
    name = _name(layer)
    for w in ("w13", "w2"):
        scales = getattr(layer, f"{w}_{scale_name}")
        for e, q in enumerate(getattr(layer, f"{w}_weight")):
            check_block_scales(f"{name} {w}[{e}]", q, scales[e])


def _expert_id_map(layer) -> torch.Tensor | None:
    """With expert parallelism SGLang hands over local ids, -1 for another rank's experts: the map
    [0, 1, ..., E - 1, -1] keeps the local ids and sends -1 (its last entry) to -1."""
    local = torch.arange(-1, layer.w13_weight.shape[0], dtype=torch.int32, device=layer.w13_weight.device)
    return None if layer.moe_ep_size == 1 else local.roll(-1)


def _fused_moe(layer, dispatch_output, config, scale_name: str, id_map):
    """The routed experts on ``fused_moe_fp8``. SGLang's runner applies ``routed_scaling_factor`` in
    its own kernels, so this does too."""
    from sglang.srt.layers.moe.token_dispatcher import StandardCombineInput

    x = dispatch_output.hidden_states
    weights, ids, _ = dispatch_output.topk_output
    scaling = config.routed_scaling_factor
    if scaling is not None and scaling != 1.0:
        weights = weights * scaling
    out = fused_moe_fp8(x, layer.w13_weight, getattr(layer, f"w13_{scale_name}"), layer.w2_weight,
                        getattr(layer, f"w2_{scale_name}"), weights, ids, stats=fp8_guard(x.device).counters,
                        expert_map=id_map, check_ids=False)
    return StandardCombineInput(hidden_states=out)


class LatentspeedFp8MoEMethod(Fp8MoEMethod):
    """SGLang's FP8 MoE method with the routed experts on ``fused_moe_fp8``: SGLang loads the
    experts, routes (fused shared experts are ordinary experts here) and reduces; bf16 experts are
    quantized to 128 x 128 blocks once loaded."""

    def __init__(self, quant_config: Fp8Config):
        super().__init__(quant_config)
        _require_triton_runner(not (self.use_mxfp8 or self.is_fp4_expert
                                    or self.is_deepgemm_moe_runner_backend_enabled()))

    def create_weights(self, layer, *args, **kwargs):
        super().create_weights(layer, *args, **kwargs)
        _refuse_mismatched_expert_dtypes(layer, "weight_scale_inv")

    def create_moe_runner(self, layer, moe_runner_config):
        _check_runner_config(layer, moe_runner_config)
        super().create_moe_runner(layer, moe_runner_config)  # keeps SGLang's runner config

    def process_weights_after_loading(self, layer) -> None:
        name = _name(layer)
        if not self.block_quant:  # a bf16 checkpoint
            for w in ("w13", "w2"):
                weight, scale = quantize_expert_weights(f"{name} {w}", getattr(layer, f"{w}_weight").data)
                setattr(layer, f"{w}_weight", torch.nn.Parameter(weight, requires_grad=False))
                setattr(layer, f"{w}_weight_scale_inv", torch.nn.Parameter(scale, requires_grad=False))
            self.block_quant, self.weight_block_size = True, BLOCK
        else:
            _check_expert_scales(layer, "weight_scale_inv")
            super().process_weights_after_loading(layer)
        self.id_map = _expert_id_map(layer)
        _warm_up_experts(layer, "weight_scale_inv", self.id_map)

    def apply(self, layer, dispatch_output):
        return _fused_moe(layer, dispatch_output, self.moe_runner_config, "weight_scale_inv", self.id_map)


class LatentspeedCTW8A8Fp8MoE(CompressedTensorsW8A8Fp8MoE):
    """compressed-tensors FP8 block experts (``w13_weight_scale`` / ``w2_weight_scale``) on
    ``fused_moe_fp8``."""

    def __init__(self, weight_quant, input_quant):
        super().__init__(weight_quant, input_quant)
        check_checkpoint_scheme(NAME, True, "static" if self.static_input_scales else "dynamic",
                                self.weight_block_size)
        _require_triton_runner()

    def create_weights(self, layer, *args, **kwargs):
        super().create_weights(layer, *args, **kwargs)
        _refuse_mismatched_expert_dtypes(layer, "weight_scale")

    def create_moe_runner(self, layer, moe_runner_config):
        _check_runner_config(layer, moe_runner_config)
        self.moe_runner_config = moe_runner_config

    def process_weights_after_loading(self, layer) -> None:
        _check_expert_scales(layer, "weight_scale")
        self.id_map = _expert_id_map(layer)
        _warm_up_experts(layer, "weight_scale", self.id_map)

    def apply_weights(self, layer, dispatch_output):
        return _fused_moe(layer, dispatch_output, self.moe_runner_config, "weight_scale", self.id_map)


class LatentspeedCTW8A8Fp8(CompressedTensorsW8A8Fp8):
    """compressed-tensors FP8 block layers with latentspeed's block GEMM."""

    def __init__(self, weight_quant, is_static_input_scheme):
        super().__init__(weight_quant, is_static_input_scheme)
        check_checkpoint_scheme(NAME, True, "static" if is_static_input_scheme else "dynamic", self.weight_block_size)
        self.w8a8_block_fp8_linear = block_linear

    def create_weights(self, layer, *args, **kwargs):
        super().create_weights(layer, *args, **kwargs)
        refuse_mismatched_dtypes(lambda: _name(layer), layer.weight, layer.weight_scale)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        check_block_scales(_name(layer), layer.weight, layer.weight_scale)
        super().process_weights_after_loading(layer)
        _warm_up_linear(layer.weight, layer.weight_scale)


class LatentspeedCTConfig(CompressedTensorsConfig):
    """compressed-tensors checkpoints under ``--quantization latentspeed_fp8``."""

    def get_name(self) -> str:
        return NAME

    @property
    def weight_block_size(self) -> list[int] | None:
        """The weight block of the checkpoint's block-FP8 groups, whatever they target: SGLang's own
        looks in a group that targets the class ``Linear`` only, and without it cannot place a fused
        layer's block scales."""
        blocks = {tuple(weights.block_structure) for scheme in self.target_scheme_map.values()
                  if (weights := scheme.get("weights")) is not None and weights.block_structure}
        if len(blocks) > 1:
            raise ValueError(f"{NAME}: the checkpoint mixes weight blocks {sorted(blocks)}; one block size is supported")
        return list(blocks.pop()) if blocks else None

    def get_quant_method(self, layer, prefix):
        _remember_prefix(layer, prefix)
        return super().get_quant_method(layer, prefix)

    def get_moe_scheme(self, layer, layer_name=None):
        scheme = super().get_moe_scheme(layer, layer_name)
        if type(scheme) is not CompressedTensorsW8A8Fp8MoE:  # ignored, or a mixed checkpoint's FP4 experts
            return scheme
        if not scheme.block_quant:
            raise ValueError(f"{NAME}: the experts of {layer_name} are quantized as FP8 per tensor or channel in "
                             "this checkpoint; only FP8 in 128 x 128 blocks is supported")
        return LatentspeedCTW8A8Fp8MoE(scheme.weight_quant, scheme.input_quant)

    def _get_scheme_from_parts(self, weight_quant, input_quant, *args, **kwargs):
        scheme = super()._get_scheme_from_parts(weight_quant, input_quant, *args, **kwargs)
        if type(scheme) is CompressedTensorsW8A8Fp8:
            if scheme.weight_block_size is None:
                raise ValueError(f"{NAME}: FP8 per tensor or per channel is not supported; 128 x 128 blocks are")
            return LatentspeedCTW8A8Fp8(scheme.weight_quant, scheme.is_static_input_scheme)
        return scheme


class LatentspeedFp8Config(Fp8Config):
    """The ``latentspeed_fp8`` method (module docstring); built with no arguments (SGLang's way for
    a checkpoint without a quantization config) it quantizes the linear layers after loading."""

    def __init__(self, is_checkpoint_fp8_serialized=False, activation_scheme="dynamic", ignored_layers=None,
                 weight_block_size=None, **kwargs):
        check_checkpoint_scheme(NAME, is_checkpoint_fp8_serialized, activation_scheme, weight_block_size)
        super().__init__(is_checkpoint_fp8_serialized, activation_scheme, ignored_layers, weight_block_size, **kwargs)

    def get_name(self) -> str:
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
    def override_quantization_method(cls, hf_quant_cfg, user_quant):
        return NAME if claims_checkpoint(hf_quant_cfg, user_quant, NAME) else None

    def get_quant_method(self, layer, prefix):
        _remember_prefix(layer, prefix)
        method = super().get_quant_method(layer, prefix)
        if type(method) is Fp8LinearMethod:
            return LatentspeedFp8LinearMethod(self)
        if type(method) is Fp8MoEMethod:
            return LatentspeedFp8MoEMethod(self)
        return method


def register_quantization() -> None:
    """Add the method to SGLang's registry, its ``--quantization`` choices, and the linear
    methods whose weights SGLang loads with its shard-aware (v2) loader."""
    import sglang.srt.layers.linear as linear
    from sglang.srt.layers.quantization import QUANTIZATION_METHODS
    from sglang.srt.server_args import QUANTIZATION_CHOICES, add_quantization_method_choices

    QUANTIZATION_METHODS[NAME] = LatentspeedFp8Config
    if NAME not in QUANTIZATION_CHOICES:
        add_quantization_method_choices([NAME])
    if LatentspeedFp8LinearMethod.__name__ not in linear.WEIGHT_LOADER_V2_SUPPORTED:
        linear.WEIGHT_LOADER_V2_SUPPORTED.append(LatentspeedFp8LinearMethod.__name__)
