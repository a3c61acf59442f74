"""A block-FP8 linear layer as both engines' adapters use it: the forward (activations quantized per
token and 128 columns by ``quantize_per_token_group``, counted by the device's fp8 guard, then the
block-scaled GEMM), the checks of what a checkpoint holds for a layer (tensor dtypes as it is
loaded, block scales once loaded), and load-time quantization of bf16 weights (a layer's, or a stack of experts')."""

import functools
from collections.abc import Callable

import torch

from ..fp8_format import FP8_DTYPES
from ..guard import fp8_guard
from .gemm import SCALE_BLOCK, block_scaled_gemm
from .quant import quantize_per_token_group, quantize_weight_blocks


def block_fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """``x [M, K]`` bf16/fp16 times the block-FP8 ``weight [N, K]`` with fp32 ``weight_scale
    [cdiv(N, 128), cdiv(K, 128)]``, accumulated in fp32. Returns ``[M, N]`` in x's dtype."""
    a, a_scale = quantize_per_token_group(x.contiguous(), SCALE_BLOCK, stats=fp8_guard(x.device).counters)
    return block_scaled_gemm(a, a_scale, weight, weight_scale.float(), out_dtype=x.dtype)


def check_block_scales(name: str, weight: torch.Tensor, scale: torch.Tensor) -> None:
    """Raise ``ValueError`` naming ``name`` when its loaded block scales are mis-shaped, missing
    (engines fill unloaded scales with the most negative fp32) or not finite and positive."""
    n, k = weight.shape
    expected = (-(-n // SCALE_BLOCK), -(-k // SCALE_BLOCK))
    if tuple(scale.shape) != expected:
        raise ValueError(f"{name}: weight scales must be [{expected[0]}, {expected[1]}] for a [{n}, {k}] weight "
                         f"in 128 x 128 blocks, got {list(scale.shape)}")
    if bool((scale == torch.finfo(scale.dtype).min).any()):
        raise ValueError(f"{name}: the checkpoint has no scale for some weight blocks "
                         "(weight_scale_inv / weight_scale missing or partial)")
    bad = int((~torch.isfinite(scale) | (scale <= 0)).sum())
    if bad:
        raise ValueError(f"{name}: {bad} weight scales are not finite and positive")


SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # block scales as checkpoints store them


def refuse_mismatched_dtypes(describe: Callable[[], str], weight: torch.nn.Parameter,
                             scale: torch.nn.Parameter) -> None:
    """Make the engine weight loaders of a block-FP8 ``weight`` and its ``scale`` raise
    ``ValueError`` naming ``describe()`` for a checkpoint tensor of another dtype: the engines copy
    whatever arrives into the fp8 parameter, so a bf16 weight under an FP8 config would be rounded
    to fp8 and multiplied by scales meant for other values. A weight that is not fp8 (a bf16
    checkpoint, quantized after loading) is left alone."""
    if weight.dtype in FP8_DTYPES:
        _refuse_other_dtypes(weight, lambda: f"{describe()} weight", (weight.dtype,))
        _refuse_other_dtypes(scale, lambda: f"{describe()} scales", SCALE_DTYPES)


def _refuse_other_dtypes(param: torch.nn.Parameter, describe: Callable[[], str], allowed) -> None:
    loader = param.weight_loader

    @functools.wraps(loader)
    def load(target, loaded_weight, *args, **kwargs):
        if loaded_weight.dtype not in allowed:
            raise ValueError(f"{describe()}: the checkpoint stores {loaded_weight.dtype}, but its quantization "
                             f"config implies {' or '.join(str(d) for d in allowed)}")
        return loader(target, loaded_weight, *args, **kwargs)

    if isinstance(getattr(type(param), "weight_loader", None), property):  # the engines' parameter classes
        param._weight_loader = load
    else:
        param.weight_loader = load


def quantize_linear_weight(name: str, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A bf16/fp16 linear weight ``[N, K]`` quantized to 128 x 128 blocks at load time
    (``quantize_weight_blocks``); raises ``ValueError`` naming ``name`` if the checkpoint holds
    non-finite weights, which would otherwise turn whole blocks of outputs into NaN."""
    stats = torch.zeros(2, dtype=torch.int32, device=weight.device)
    q, scale = quantize_weight_blocks(weight.contiguous(), block=SCALE_BLOCK, stats=stats)
    nonfinite = int(stats[1])
    if nonfinite:
        raise ValueError(f"{name}: the checkpoint holds {nonfinite} non-finite weights")
    return q, scale


def quantize_expert_weights(name: str, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16/fp16 expert weights ``[E, N, K]`` quantized to 128 x 128 blocks at load time, one expert at a time
    (``quantize_weight_blocks``): ``(q [E, N, K] E4M3, scales [E, cdiv(N, 128), cdiv(K, 128)] fp32)``. Raises
    ``ValueError`` naming ``name`` and the experts if the checkpoint holds non-finite weights."""
    experts, n, k = weights.shape
    stats = torch.zeros(experts, 2, dtype=torch.int32, device=weights.device)
    q = torch.empty(weights.shape, dtype=torch.float8_e4m3fn, device=weights.device)
    scales = torch.empty(experts, -(-n // SCALE_BLOCK), -(-k // SCALE_BLOCK), dtype=torch.float32,
                         device=weights.device)
    for e in range(experts):
        q[e], scales[e] = quantize_weight_blocks(weights[e].contiguous(), block=SCALE_BLOCK, stats=stats[e])
    nonfinite = stats[:, 1].tolist()
    if any(nonfinite):
        raise ValueError(f"{name}: the checkpoint holds {sum(nonfinite)} non-finite weights, in experts "
                         f"{[e for e, count in enumerate(nonfinite) if count]}")
    return q, scales
