"""Compile the block-FP8 layers' kernels before serving, for every batch of 1 to ``max_tokens`` tokens.

Which kernels a layer launches for a batch of ``M`` tokens, and how Triton compiles them, depends on
``M`` alone: the GEMM's and the MoE's configs are tuned per bucket of ``M``, some constexprs follow it
(the quantizers' row blocks up to 16 rows, the MoE's alignment chunks), and Triton compiles integer
arguments equal to 1 or divisible by 16 apart. An engine's own warm-up runs a few batch sizes, so the
others used to compile while serving: 5-50 s stalls in timed passes
(``benchmarks/results/vllm-e2e-throughput-h100-2026-12-06-s39.md``), and an error under vLLM's
``--jit-monitor-mode=error``. So these run each layer signature (shapes, dtypes, device) once on zeros
at every ``M`` up to ``FULL_SWEEP_TOKENS``, and above it at one ``M`` of each set of sizes that launch
alike (``representative_sizes``; the GEMM's and the MoE's ``launch_key``).

Set ``LATENTSPEED_FP8_WARMUP=0`` to skip (start-up time against first-batch stalls). Batches go up to
``MAX_WARMUP_TOKENS`` at most, since an engine without chunked prefill hands over whole prompts.
Launches still compile later where an engine hands over what a warm-up cannot foresee: inputs whose
rows are not 16-byte aligned, ``topk_ids`` that are not int32 (both engines' routers make int32),
batches beyond that bound.
"""

import contextlib
import logging
import os
import time

import torch
from triton import knobs

from ..guard import fp8_guard
from . import gemm, moe
from .gemm import SCALE_BLOCK
from .linear import block_fp8_linear
from .moe import fused_moe_fp8
from .norm_quant import MAX_COLS, rms_norm_group_quant
from .silu_mul_quant import silu_mul_group_quant

WARMUP_ENV = "LATENTSPEED_FP8_WARMUP"
MAX_WARMUP_TOKENS = 16384
FULL_SWEEP_TOKENS = 256  # every batch size up to here: the small batches' tiles, K splits and row blocks change often
logger = logging.getLogger("latentspeed")
_warmed: set[tuple] = set()


def warmup_wanted(device: torch.device) -> bool:
    """Whether to warm up on ``device``: a GPU (Triton's CPU interpreter compiles nothing) and
    ``LATENTSPEED_FP8_WARMUP`` unset or ``1``; another value raises ``ValueError`` naming it."""
    setting = os.environ.get(WARMUP_ENV, "1")
    if setting not in ("0", "1"):
        raise ValueError(f"{WARMUP_ENV}={setting!r}: use 1 (compile every batch size at load) or 0 (do not)")
    return setting == "1" and device.type == "cuda"


def _first_time(signature: tuple, device: torch.device) -> bool:
    if signature in _warmed or not warmup_wanted(device):
        return False
    _warmed.add(signature)
    return True


@contextlib.contextmanager
def counting_compiles():
    """Count Triton's ``compile`` calls inside the block (kernels missing from the process's memory): how many
    were built and how many were loaded from Triton's disk cache, and in which cache folders. Yields a dict
    ``{"built": int, "loaded": int, "cache_dirs": set}``. Chains to a compilation listener set before."""
    counts, previous = {"built": 0, "loaded": 0, "cache_dirs": set()}, knobs.compilation.listener

    def listener(**kwargs):
        counts["loaded" if kwargs["cache_hit"] else "built"] += 1
        counts["cache_dirs"].add(knobs.cache.dir)
        if previous is not None:
            previous(**kwargs)

    knobs.compilation.listener = listener
    try:
        yield counts
    finally:
        knobs.compilation.listener = previous


def _done(device: torch.device, what: str, max_tokens: int, start: float, compiles: dict) -> None:
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()  # the zeros and outputs: not to be counted as the model's memory by the engine
    logger.info("latentspeed: %s warmed up for 1-%d tokens in %.1f s (Triton kernels built: %d, loaded from its cache: "
                "%d, cache folders: %s)", what, max_tokens, time.perf_counter() - start, compiles["built"],
                compiles["loaded"], ", ".join(sorted(compiles["cache_dirs"])) or "none used")


def representative_sizes(max_tokens: int, launch_key) -> list[int]:
    """Every batch size up to ``FULL_SWEEP_TOKENS``, then the smallest size of each set of sizes up to
    ``max_tokens`` with the same ``launch_key(M)`` (what, besides ``M`` as a runtime value, decides which
    kernels launch and how Triton compiles them)."""
    sizes, keys = list(range(1, min(max_tokens, FULL_SWEEP_TOKENS) + 1)), set()
    for m in range(FULL_SWEEP_TOKENS + 1, max_tokens + 1):
        key = launch_key(m)
        if key not in keys:
            keys.add(key)
            sizes.append(m)
    return sizes


def warm_up_linear(weight: torch.Tensor, weight_scale: torch.Tensor, max_tokens: int, dtype: torch.dtype) -> bool:
    """Run ``block_fp8_linear`` on ``[M, K]`` zeros of ``dtype`` with this ``weight [N, K]`` (fp8) and
    ``weight_scale`` for the ``representative_sizes`` of ``1..max_tokens`` (at most ``MAX_WARMUP_TOKENS``)
    by ``gemm.launch_key``, unless a layer of the same signature was warmed already or ``warmup_wanted``
    says no. Returns whether it ran."""
    max_tokens = min(max_tokens, MAX_WARMUP_TOKENS)
    signature = ("linear", tuple(weight.shape), weight.dtype, weight_scale.dtype, dtype, max_tokens, weight.device)
    if not _first_time(signature, weight.device):
        return False
    start, (n, k) = time.perf_counter(), weight.shape
    x = torch.zeros(max_tokens, k, dtype=dtype, device=weight.device)
    with counting_compiles() as compiles:
        for m in representative_sizes(max_tokens, lambda m: gemm.launch_key(m, n, k, weight.device)):
            block_fp8_linear(x[:m], weight, weight_scale)
    del x
    _done(weight.device, f"block-FP8 linear {list(weight.shape)}", max_tokens, start, compiles)
    return True


def warm_up_producers(cols: int, max_tokens: int, dtype: torch.dtype, device: torch.device, norm: bool,
                      silu_mul: bool) -> bool:
    """Run the producers an engine may fuse in front of a linear layer of ``cols`` input columns, on
    zeros of ``dtype``, for the ``representative_sizes`` of ``1..max_tokens``, as the fused ops call them:
    where ``norm``, ``rms_norm_group_quant`` of ``[M, cols]`` with and without a residual (where a row
    fits, ``cols <= MAX_COLS``); where ``silu_mul``, ``silu_mul_group_quant`` of ``[M, 2 cols]``. Above
    ``FULL_SWEEP_TOKENS`` their launches differ only in whether ``M`` divides by 16. Unless warmed
    already for this signature or ``warmup_wanted`` says no. Returns whether it ran."""
    norm, max_tokens = norm and cols <= MAX_COLS, min(max_tokens, MAX_WARMUP_TOKENS)
    signature = ("producers", cols, max_tokens, dtype, norm, silu_mul, device)
    if not (norm or silu_mul) or not _first_time(signature, device):
        return False
    start, stats = time.perf_counter(), fp8_guard(device).counters
    rows = torch.zeros(max_tokens, cols, dtype=dtype, device=device)
    weight = torch.ones(cols, dtype=dtype, device=device)
    x = torch.zeros(max_tokens, 2 * cols, dtype=dtype, device=device) if silu_mul else None
    with counting_compiles() as compiles:
        for m in representative_sizes(max_tokens, lambda m: m % 16 == 0):
            if norm:
                rms_norm_group_quant(rows[:m], weight, 1e-6, group_size=SCALE_BLOCK, stats=stats)
                rms_norm_group_quant(rows[:m], weight, 1e-6, rows[:m], SCALE_BLOCK, stats=stats)
            if silu_mul:
                silu_mul_group_quant(x[:m], SCALE_BLOCK, stats=stats)
    del x, rows
    _done(device, f"fused producers of {cols} columns", max_tokens, start, compiles)
    return True


def moe_inputs(max_tokens: int, hidden: int, top_k: int, experts: int, dtype: torch.dtype, device: torch.device):
    """What ``warm_up_moe`` runs its batches on: ``x [max_tokens, hidden]`` zeros of ``dtype``, int32 ``topk_ids``
    cycling over the ``experts`` and fp32 routing weights of ``1 / top_k``; a batch of ``M`` is their first rows."""
    x = torch.zeros(max_tokens, hidden, dtype=dtype, device=device)
    ids = (torch.arange(max_tokens * top_k, device=device) % experts).to(torch.int32).view(max_tokens, top_k)
    return x, ids, torch.full((max_tokens, top_k), 1.0 / top_k, dtype=torch.float32, device=device)


def warm_up_moe(w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor, top_k: int,
                max_tokens: int, dtype: torch.dtype, expert_map: torch.Tensor | None = None) -> bool:
    """Run ``fused_moe_fp8`` on ``[M, H]`` zeros of ``dtype`` for the ``representative_sizes`` of
    ``1..max_tokens`` by ``moe.launch_key``, each token routed to ``top_k`` experts in turn (int32
    ``topk_ids``; ``expert_map`` as the layer's; the device's fp8 guard counting, as the engine adapters
    have it), unless a layer of the same signature was warmed already or ``warmup_wanted`` says no. The
    launches depend on ``T * top_k`` and the expert count, not on the routing. Returns whether it ran."""
    experts, _, hidden = w13.shape
    max_tokens = min(max_tokens, MAX_WARMUP_TOKENS)
    signature = ("moe", tuple(w13.shape), tuple(w2.shape), w13.dtype, w13_scale.dtype, top_k, max_tokens, dtype,
                 None if expert_map is None else (tuple(expert_map.shape), expert_map.dtype), w13.device)
    if not _first_time(signature, w13.device):
        return False
    start, stats = time.perf_counter(), fp8_guard(w13.device).counters
    global_experts = experts if expert_map is None else expert_map.shape[0]
    x, ids, weights = moe_inputs(max_tokens, hidden, top_k, global_experts, dtype, w13.device)
    with counting_compiles() as compiles:
        for m in representative_sizes(max_tokens, lambda m: moe.launch_key(m, top_k, w13, w2)):
            fused_moe_fp8(x[:m], w13, w13_scale, w2, w2_scale, weights[:m], ids[:m], stats=stats,
                          expert_map=expert_map, check_ids=False)
    del x, ids, weights
    _done(w13.device, f"block-FP8 MoE {list(w13.shape)} top-{top_k}", max_tokens, start, compiles)
    return True
