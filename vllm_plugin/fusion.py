"""The producers of latentspeed's block-FP8 linear inputs fused with their activation
quantization, as one pass of vLLM's compiler:

- RMSNorm (on by default; ``LATENTSPEED_FUSE_NORM_QUANT=0`` turns it off);
- SiLU-and-mul before a ``down_proj`` (on by default; ``LATENTSPEED_FUSE_SILU_QUANT=0`` turns it
  off).

``latentspeed.block_fp8_linear`` quantizes its input itself, inside one opaque op, so neither
Inductor nor vLLM's own ``RMSNormQuantFusionPass`` and ``ActivationQuantFusionPass`` (which match
vLLM's quantization ops) can fuse the producer in front of it. ``QuantFusionPass`` rewrites, in the
post-grad graph::

    rms_norm(x, w, eps)                  -> block_fp8_linear(y, W, Ws)
    fused_add_rms_norm(x, r, w, eps)     -> block_fp8_linear(y, W, Ws), residual
    silu(x[:, :d]) * x[:, d:]            -> block_fp8_linear(y, W, Ws)

into ``latentspeed.rms_norm_group_quant`` (or ``add_rms_norm_group_quant``, which also returns the
residual) or ``latentspeed.silu_mul_group_quant``, and ``latentspeed.block_fp8_gemm`` on the
quantized rows (``common_kernels.fp8.norm_quant``, ``.silu_mul_quant``): the producer's output
never goes to memory in bf16, and one launch goes. A producer's output with other users
(DeepSeek-V3's MoE input also feeds the router) is left alone, as are norms over part of a row and
rows over ``MAX_COLS``.

Constants of a traced pattern must match the graph's literally: the norm patterns are registered
for the usual epsilons, and the SiLU-and-mul patterns (vLLM's native ``SiluAndMul``, whose slices
carry the gate width) for each width the graph holds, when the pass first sees it.

The pass takes vLLM's post-grad custom pass slot (``inductor_compile_config``'s
``post_grad_custom_post_pass``) when the first latentspeed linear layer is built, unless the user
put a pass there; it runs under ``-O`` levels that compile (``CompilationMode.VLLM_COMPILE``).
"""

import logging

import torch
import torch._inductor.pattern_matcher as pm
import vllm.ir.ops
from torch import fx
from torch._inductor.pattern_matcher import PatternMatcherPass
from vllm.compilation.passes.inductor_pass import enable_fake_mode
from vllm.compilation.passes.vllm_inductor_pass import VllmInductorPass, VllmPatternMatcherPass
from vllm.config import CompilationMode, VllmConfig, get_current_vllm_config
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.platforms import current_platform
from vllm.utils.torch_utils import direct_register_custom_op

from common_kernels.fp8 import (
    FUSE_NORM_ENV,
    FUSE_SILU_ENV,
    SCALE_BLOCK,
    block_scaled_gemm,
    fusion_switch,
    rms_norm_group_quant,
    silu_mul_group_quant,
)
from common_kernels.fp8.norm_quant import MAX_COLS
from common_kernels.guard import fp8_guard

logger = logging.getLogger("latentspeed")

NORM_ENV, SILU_ENV = FUSE_NORM_ENV, FUSE_SILU_ENV
EPSILONS = (1e-5, 1e-6)  # as vLLM's own norm fusion: the epsilon is a constant of each pattern


def _rms_norm_quant(x: torch.Tensor, weight: torch.Tensor, epsilon: float) -> tuple[torch.Tensor, torch.Tensor]:
    q, scales, _ = rms_norm_group_quant(x, weight, epsilon, group_size=SCALE_BLOCK, stats=fp8_guard(x.device).counters)
    return q, scales


def _add_rms_norm_quant(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        epsilon: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return rms_norm_group_quant(x, weight, epsilon, residual, SCALE_BLOCK, stats=fp8_guard(x.device).counters)


def _silu_mul_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return silu_mul_group_quant(x, SCALE_BLOCK, stats=fp8_guard(x.device).counters)


def _gemm(a: torch.Tensor, a_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
          dtype_of: torch.Tensor) -> torch.Tensor:
    """The GEMM on rows quantized by a producer; the output in ``dtype_of``'s dtype (the norm's
    weight or the activation's input, whose dtype is the activations': a tensor, since a pattern's
    replacement would fix a dtype argument when it is traced)."""
    return block_scaled_gemm(a, a_scale, weight, weight_scale.float(), out_dtype=dtype_of.dtype)


def _quantized_fake(x: torch.Tensor, cols: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    cols = x.shape[1] if cols is None else cols
    return (x.new_empty(x.shape[0], cols, dtype=torch.float8_e4m3fn),
            x.new_empty(x.shape[0], -(-cols // SCALE_BLOCK), dtype=torch.float32))


def _rms_norm_quant_fake(x, weight, epsilon):
    return _quantized_fake(x)


def _add_rms_norm_quant_fake(x, residual, weight, epsilon):
    return *_quantized_fake(x), torch.empty_like(x)


def _silu_mul_quant_fake(x):
    return _quantized_fake(x, x.shape[1] // 2)


def _gemm_fake(a, a_scale, weight, weight_scale, dtype_of):
    return a.new_empty(a.shape[0], weight.shape[0], dtype=dtype_of.dtype)


_LIBRARY = torch.library.Library("latentspeed", "FRAGMENT")  # alive as long as the module
direct_register_custom_op("rms_norm_group_quant", _rms_norm_quant, fake_impl=_rms_norm_quant_fake,
                          target_lib=_LIBRARY)
direct_register_custom_op("add_rms_norm_group_quant", _add_rms_norm_quant, fake_impl=_add_rms_norm_quant_fake,
                          target_lib=_LIBRARY)
direct_register_custom_op("silu_mul_group_quant", _silu_mul_quant, fake_impl=_silu_mul_quant_fake,
                          target_lib=_LIBRARY)
direct_register_custom_op("block_fp8_gemm", _gemm, fake_impl=_gemm_fake, target_lib=_LIBRARY)


_RMS_NORM, _ADD_RMS_NORM = torch.ops.vllm_ir.rms_norm.default, torch.ops.vllm_ir.fused_add_rms_norm.default


def _norm_fusable(match: pm.Match) -> bool:
    """The norm's input and weight share a 16-bit dtype, and a row fits the fused kernel."""
    for node in match.nodes:
        if node.target in (_RMS_NORM, _ADD_RMS_NORM):
            x, weight = node.args[0], node.args[1 if node.target == _RMS_NORM else 2]
            x_val, weight_val = x.meta["val"], weight.meta["val"]
            return (x_val.dtype == weight_val.dtype and x_val.dtype in (torch.bfloat16, torch.float16)
                    and x_val.dim() == 2 and x_val.shape[-1] <= MAX_COLS)
    return False


def _register_norm(patterns: PatternMatcherPass, epsilon: float) -> None:
    """The two norm patterns for one epsilon; the one with the residual first (the plain norm's is
    part of it in torch ops)."""
    linear, norm_quant = torch.ops.latentspeed.block_fp8_linear.default, torch.ops.latentspeed.rms_norm_group_quant
    add_norm_quant, gemm = torch.ops.latentspeed.add_rms_norm_group_quant, torch.ops.latentspeed.block_fp8_gemm

    def add_pattern(x, residual, weight, w, w_scale):
        y, residual_out = vllm.ir.ops.fused_add_rms_norm(x, residual, weight, epsilon)
        return linear(y, w, w_scale), residual_out

    def add_replacement(x, residual, weight, w, w_scale):
        q, scales, residual_out = add_norm_quant(x, residual, weight, epsilon)
        return gemm(q, scales, w, w_scale, weight), residual_out

    def pattern(x, weight, w, w_scale):
        return linear(vllm.ir.ops.rms_norm(x, weight, epsilon), w, w_scale)

    def replacement(x, weight, w, w_scale):
        q, scales = norm_quant(x, weight, epsilon)
        return gemm(q, scales, w, w_scale, weight)

    x, residual = torch.empty(5, 256, dtype=torch.bfloat16), torch.empty(5, 256, dtype=torch.bfloat16)
    weight = torch.empty(256, dtype=torch.bfloat16)
    w, w_scale = torch.empty(64, 256, dtype=torch.float8_e4m3fn), torch.empty(1, 2, dtype=torch.float32)
    pm.register_replacement(add_pattern, add_replacement, [x, residual, weight, w, w_scale], pm.fwd_only, patterns,
                            extra_check=_norm_fusable)  # distinct example tensors: the tracer merges repeated ones
    pm.register_replacement(pattern, replacement, [x, weight, w, w_scale], pm.fwd_only, patterns,
                            extra_check=_norm_fusable)


def _gate_widths(graph: fx.Graph) -> set[int]:
    """Widths ``d`` of the ``x[:, :d]`` slices of 2-D ``[M, 2 d]`` tensors: SiLU-and-mul's gates."""
    widths = set()
    for node in graph.find_nodes(op="call_function", target=torch.ops.aten.slice.Tensor):
        source, dim, start, end = (*node.args, None, None, None)[:4]
        shape = source.meta["val"].shape if isinstance(source, fx.Node) and "val" in source.meta else ()
        if (len(shape) == 2 and dim in (1, -1) and start == 0 and isinstance(end, int)
                and isinstance(shape[1], int) and shape[1] == 2 * end):
            widths.add(end)
    return widths


def _register_silu_mul(patterns: PatternMatcherPass, width: int, dtype: torch.dtype) -> None:
    """vLLM's native SiLU-and-mul of a ``[M, 2 * width]`` ``dtype`` input feeding a linear layer."""
    linear, silu_quant = torch.ops.latentspeed.block_fp8_linear.default, torch.ops.latentspeed.silu_mul_group_quant
    gemm = torch.ops.latentspeed.block_fp8_gemm

    def pattern(x, w, w_scale):
        return linear(SiluAndMul.forward_native(x), w, w_scale)

    def replacement(x, w, w_scale):
        q, scales = silu_quant(x)
        return gemm(q, scales, w, w_scale, x)

    x = torch.empty(5, 2 * width, dtype=dtype)
    w = torch.empty(64, width, dtype=torch.float8_e4m3fn)
    w_scale = torch.empty(1, -(-width // SCALE_BLOCK), dtype=torch.float32)
    pm.register_replacement(pattern, replacement, [x, w, w_scale], pm.fwd_only, patterns)


class QuantFusionPass(VllmPatternMatcherPass):
    """The post-grad pass of the module docstring, with the producers ``norm`` and ``silu_mul``
    turned on or off."""

    @enable_fake_mode
    def __init__(self, config: VllmConfig, norm: bool = True, silu_mul: bool = False) -> None:
        super().__init__(config)
        self.norm, self.silu_mul = norm, silu_mul
        self.patterns = PatternMatcherPass(pass_name="latentspeed_quant_fusion_pass")
        self.gate_widths: set[int] = set()
        if norm:
            for epsilon in EPSILONS:
                _register_norm(self.patterns, epsilon)

    @enable_fake_mode
    def _register_gate_widths(self, widths: set[int]) -> None:
        for width in sorted(widths - self.gate_widths):
            for dtype in (torch.bfloat16, torch.float16):
                _register_silu_mul(self.patterns, width, dtype)
            self.gate_widths.add(width)

    @VllmInductorPass.time_and_log
    def __call__(self, graph: fx.Graph) -> None:
        if self.silu_mul:
            self._register_gate_widths(_gate_widths(graph))
        self.matched_count = self.patterns.apply(graph)
        VllmPatternMatcherPass.match_table[self.pass_name] += self.matched_count  # vLLM's get_match_table()
        logger.info("latentspeed: fused %s producers with their fp8 quantization in this graph", self.matched_count)

    def uuid(self) -> str:
        return self.hash_dict({"source": self.hash_source(self, _register_norm, _norm_fusable, _gate_widths,
                                                          _register_silu_mul),
                               "norm": self.norm, "silu_mul": self.silu_mul})


def install(config: VllmConfig | None = None) -> bool:
    """Put ``QuantFusionPass`` in vLLM's post-grad custom pass slot of ``config`` (default: the
    config being built) when vLLM compiles the model and a producer is turned on
    (``LATENTSPEED_FUSE_NORM_QUANT`` and ``LATENTSPEED_FUSE_SILU_QUANT``, both default 1);
    returns whether it is there. Idempotent; leaves a pass the user put there."""
    norm, silu_mul = fusion_switch(NORM_ENV, "1"), fusion_switch(SILU_ENV, "1")
    if not (norm or silu_mul):
        return False
    config = config or get_current_vllm_config()
    if config.compilation_config.mode != CompilationMode.VLLM_COMPILE:
        return False
    slot = config.compilation_config.inductor_compile_config
    present = slot.get(current_platform.pass_key)
    if isinstance(present, QuantFusionPass):
        return True
    if present is not None:
        logger.warning("latentspeed: producer + fp8 quantization fusion not installed: inductor_compile_config[%r] "
                       "already holds %r (%s=0 silences this)", current_platform.pass_key, present, NORM_ENV)
        return False
    slot[current_platform.pass_key] = QuantFusionPass(config, norm, silu_mul)
    return True


def fused_producers(config: VllmConfig | None = None) -> tuple[bool, bool]:
    """Which producers (RMSNorm, SiLU-and-mul) the ``QuantFusionPass`` installed in ``config``
    (default: the config being built) fuses; neither where none is installed."""
    config = config or get_current_vllm_config()
    present = config.compilation_config.inductor_compile_config.get(current_platform.pass_key)
    return (present.norm, present.silu_mul) if isinstance(present, QuantFusionPass) else (False, False)
