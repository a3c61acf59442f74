"""``--quantization latentspeed_fp8`` in SGLang: DeepSeek-V3's block FP8 (W8A8, 128 x 128 weight
blocks, activations quantized per token and 128 columns at run time) with the linear layers'
GEMM from ``common_kernels.fp8`` -- the same method name and math as in vLLM.

Checkpoints: native DeepSeek-V3 FP8 (``weight_scale_inv``) and compressed-tensors FP8 block
(``weight_scale``), claimed when the user asks for this method; bf16 checkpoints, whose linear
layers are quantized to 128 x 128 blocks after loading. SGLang's classes load the weights; only
``w8a8_block_fp8_linear`` is swapped. MoE experts stay SGLang's own (block FP8 for FP8
checkpoints; its online per-tensor FP8 for bf16 ones), and DeepSeek's ``kv_b_proj`` is
dequantized for weight absorption from the checkpoint's scales, as with SGLang's ``fp8``.
"""

import torch
from sglang.srt.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig
from sglang.srt.layers.quantization.compressed_tensors.schemes import CompressedTensorsW8A8Fp8
from sglang.srt.layers.quantization.fp8 import Fp8Config, Fp8LinearMethod

from common_kernels.fp8 import (
    SCALE_BLOCK,
    block_fp8_linear,
    check_block_scales,
    check_checkpoint_scheme,
    quantize_linear_weight,
)

NAME = "latentspeed_fp8"
BLOCK = [SCALE_BLOCK, SCALE_BLOCK]


def block_linear(input, weight, block_size, weight_scale, input_scale=None, bias=None):
    """SGLang's ``w8a8_block_fp8_linear`` signature over latentspeed's GEMM."""
    if input_scale is not None or list(block_size) != BLOCK:
        raise ValueError(f"{NAME}: needs bf16/fp16 activations and 128 x 128 blocks, got block {list(block_size)}"
                         f"{' and pre-quantized activations' if input_scale is not None else ''}")
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

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        name = f"{NAME}: {getattr(layer, 'prefix', None) or type(layer).__name__}"
        if not self.block_quant:  # a bf16 checkpoint
            weight, scale = quantize_linear_weight(name, layer.weight.data)
            layer.weight = torch.nn.Parameter(weight, requires_grad=False)
            layer.weight_scale_inv = torch.nn.Parameter(scale, requires_grad=False)
            self.block_quant, self.weight_block_size = True, BLOCK
            return
        check_block_scales(name, layer.weight, layer.weight_scale_inv)
        super().process_weights_after_loading(layer)


class LatentspeedCTW8A8Fp8(CompressedTensorsW8A8Fp8):
    """compressed-tensors FP8 block layers with latentspeed's block GEMM."""

    def __init__(self, weight_quant, is_static_input_scheme):
        super().__init__(weight_quant, is_static_input_scheme)
        check_checkpoint_scheme(NAME, True, "static" if is_static_input_scheme else "dynamic", self.weight_block_size)
        self.w8a8_block_fp8_linear = block_linear

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        check_block_scales(f"{NAME}: {getattr(layer, 'prefix', None) or type(layer).__name__}",
                           layer.weight, layer.weight_scale)
        super().process_weights_after_loading(layer)


class LatentspeedCTConfig(CompressedTensorsConfig):
    """compressed-tensors checkpoints under ``--quantization latentspeed_fp8``."""

    def get_name(self) -> str:
        return NAME

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
        return 89

    @classmethod
    def from_config(cls, config: dict):
        if config.get("quant_method") == "compressed-tensors":
            return LatentspeedCTConfig.from_config(config)
        return super().from_config(config)

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant):
        claimed = isinstance(hf_quant_cfg, dict) and hf_quant_cfg.get("quant_method") in ("fp8", "compressed-tensors")
        return NAME if user_quant == NAME and claimed else None

    def get_quant_method(self, layer, prefix):
        method = super().get_quant_method(layer, prefix)
        return LatentspeedFp8LinearMethod(self) if type(method) is Fp8LinearMethod else method


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
