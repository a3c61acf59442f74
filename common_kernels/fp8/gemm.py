"""Block-scaled fp8 GEMM, W8A8 (DeepSeek-V3's recipe: 128 x 128 weight blocks, 1 x 128 activation groups).

    C[m, n] = sum over K blocks kb of  a_scale[m, kb] * b_scale[n // 128, kb] * sum_{k in kb} A[m, k] B[n, k]

``A [M, K]`` fp8 activations with ``a_scale [M, cdiv(K, 128)]`` (``quantize_per_token_group``),
``B [N, K]`` fp8 weights (the ``nn.Linear`` layout) with ``b_scale [cdiv(N, 128), cdiv(K, 128)]``
(DeepSeek-V3's ``weight_scale_inv``). Each 128-wide K block is one fp8 tensor-core dot into an fp32
partial that is scaled before it joins the fp32 accumulator, so no scale ever multiplies an fp8
value. Output ``C [M, N]`` bf16 (or fp16). K need not be a multiple of 128: the last block is
masked. The recipe: DeepSeek-V3 report (arXiv:2412.19437), section 3.3.
"""

import functools
import json
import math
import os
from pathlib import Path

import torch
import triton
import triton.language as tl

from ..fp8_format import FP8_DTYPES
from . import gemm_sm90, gemm_sm90_ws

SCALE_BLOCK = 128
CONFIG_DIR = Path(__file__).parent / "configs"


@triton.jit
def _block_scaled_gemm_kernel(
    a_ptr, b_ptr, c_ptr, a_scale_ptr, b_scale_ptr, out_ptr, counters_ptr,
    M, N, K, stride_am, stride_bn, stride_cm, stride_cs, stride_asm, stride_bsn, stride_om,
    splits, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
    SWAP_AB: tl.constexpr, SUM_IN_LAUNCH: tl.constexpr,
):
    """One ``BLOCK_M x BLOCK_N`` tile over the K blocks of split ``program_id(1)`` of ``splits``.
    Tiles are ordered in groups of ``GROUP_M`` rows of tiles, so neighbouring programs share B in
    L2. With ``splits > 1``, c is the fp32 ``[splits, M, N]`` partial: summed by ``_split_k_sum_kernel``
    after, or, with ``SUM_IN_LAUNCH``, here: each split counts itself done on the tile's int32 counter
    (``counters_ptr[pid]``, zero before and after the launch), and the last of the tile sums the partials
    in split order (as ``_split_k_sum_kernel`` does, so the result is the same to the bit) into ``out``.
    ``SWAP_AB``: the products are taken as ``B A^T`` (B's rows as the MMA's M, at least 64 on Hopper's
    wgmma; A's few rows as its N) into a ``[BLOCK_N, BLOCK_M]`` sum, transposed once at the end."""
    pid, split = tl.program_id(0), tl.program_id(1)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * tiles_n)) % rows_in_group
    pid_n = (pid % (GROUP_M * tiles_n)) // rows_in_group
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    a_rows = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am
    b_rows = b_ptr + offs_n.to(tl.int64)[:, None] * stride_bn
    a_scales = a_scale_ptr + offs_m.to(tl.int64) * stride_asm  # [BLOCK_M]
    b_scales = b_scale_ptr + (offs_n // BLOCK_K).to(tl.int64) * stride_bsn  # [BLOCK_N]
    b_scale_tile = b_scale_ptr + pid_n.to(tl.int64) * stride_bsn  # when BLOCK_N == BLOCK_K
    k_blocks = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_blocks, splits)
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kb in range(split * per_split, tl.minimum(split * per_split + per_split, k_blocks)):
        mask_k = kb * BLOCK_K + offs_k < K
        a = tl.load(a_rows + kb * BLOCK_K + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(b_rows + kb * BLOCK_K + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        a_s = tl.load(a_scales + kb, mask=mask_m, other=0.0)
        if BLOCK_N == BLOCK_K:  # the tile is one weight block wide: one weight scale, one multiply an output
            a_s = a_s * tl.load(b_scale_tile + kb)
            if SWAP_AB:
                acc += tl.dot(b, tl.trans(a)) * a_s[None, :]
            else:
                acc += tl.dot(a, tl.trans(b)) * a_s[:, None]
        else:
            b_s = tl.load(b_scales + kb, mask=mask_n, other=0.0)
            if SWAP_AB:
                acc += tl.dot(b, tl.trans(a)) * b_s[:, None] * a_s[None, :]  # [BLOCK_N, BLOCK_M]
            else:
                acc += tl.dot(a, tl.trans(b)) * a_s[:, None] * b_s[None, :]  # [BLOCK_M, BLOCK_N]
    if SWAP_AB:
        acc = tl.trans(acc)
    tile = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    tl.store(tile + split.to(tl.int64) * stride_cs, acc.to(c_ptr.dtype.element_ty), mask=mask)
    if SUM_IN_LAUNCH:
        tl.debug_barrier()  # every thread's partial is written before the count releases it
        if tl.atomic_add(counters_ptr + pid, 1, sem="acq_rel") == splits - 1:
            total, part = tl.zeros([BLOCK_M, BLOCK_N], tl.float32), tile
            for _ in range(0, splits):  # through L2: the other splits' partials were written by other SMs
                total += tl.load(part, mask=mask, other=0.0, cache_modifier=".cg")
                part += stride_cs
            out = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
            tl.store(out, total.to(out_ptr.dtype.element_ty), mask=mask)
            tl.store(counters_ptr + pid, 0)  # for the next launch on this stream (and a CUDA graph's next replay)


@triton.jit
def _split_k_sum_kernel(partial_ptr, c_ptr, M, N, stride_cm, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    """``c = sum over splits of partial[split]`` (fp32 ``[SPLIT_K, M, N]``), in c's dtype."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    acc = tl.zeros([BLOCK], tl.float32)
    for split in tl.static_range(SPLIT_K):
        acc += tl.load(partial_ptr + split * M * N + offs, mask=mask, other=0.0)
    tl.store(c_ptr + (offs // N) * stride_cm + offs % N, acc.to(c_ptr.dtype.element_ty), mask=mask)


def default_config(m: int, n: int, k: int, sms: int, hopper: bool = False) -> dict:
    """A config for shapes no tuned table covers: tile by M, then split K until the tiles fill
    the GPU twice over (small M reads the whole weight: every SM must stream), keeping at least
    four K blocks per split.

    ``hopper`` (an sm_90 GPU, E4M3 operands with 16-byte aligned rows): from M = 256, where 128 x 64
    tiles fill more than half the GPU, the warp-specialized kernel instead, 128 columns wide where
    128 x 128 tiles fill three quarters of it. On the H200 tuning chose that kernel for 16 of the 18
    entries at M >= 256, and this rule picks it, at the chosen width, for those 16; of the other two
    it keeps the Triton kernel for (M, N) = (256, 2112) and misses (256, 32768) at K = 512."""
    if hopper and m >= 256 and triton.cdiv(m, 128) * triton.cdiv(n, 64) > sms // 2:
        block_n = 128 if triton.cdiv(m, 128) * triton.cdiv(n, 128) >= 3 * sms // 4 else 64
        return dict(BLOCK_M=128, BLOCK_N=block_n, SPLIT_K=1, GROUP_M=8, num_warps=4,
                    num_stages=6 if m <= 1024 else 5, KERNEL="sm90_ws")
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128
    block_n = 64 if m <= 64 else 128
    tiles, k_blocks, split = triton.cdiv(m, block_m) * triton.cdiv(n, block_n), triton.cdiv(k, SCALE_BLOCK), 1
    while tiles * split < 2 * sms and k_blocks // (2 * split) >= 4:
        split *= 2
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, SPLIT_K=split, GROUP_M=8, num_warps=8 if block_m == 128 else 4,
                num_stages=3 if block_m == 128 else 4)


def tuned_table_path(kind: str, device_name: str) -> Path:
    """Where the ``kind`` (``gemm`` or ``moe``) table for this GPU is read from:
    ``LATENTSPEED_FP8_<KIND>_CONFIGS``, else ``configs/<kind>_<GPU name, spaces as _>.json``."""
    return Path(os.environ.get(f"LATENTSPEED_FP8_{kind.upper()}_CONFIGS")
                or CONFIG_DIR / f"{kind}_{device_name.replace(' ', '_')}.json")


@functools.cache
def tuned_table(kind: str, device_name: str) -> dict:
    """The ``configs`` of the table at ``tuned_table_path`` (written by ``benchmarks/tune_fp8_<kind>.py``),
    or empty where there is none. GEMM: ``{"N,K": {"M": config}}``; MoE: ``{"E,H,I,k": {"tokens": config}}``."""
    path = tuned_table_path(kind, device_name)
    return json.loads(path.read_text())["configs"] if path.is_file() else {}


def nearest_tuned(by_m: dict, m: int) -> dict:
    """The entry of ``{"M": config}`` whose M is nearest to ``m`` in log scale."""
    return by_m[min(by_m, key=lambda tuned: abs(math.log2(int(tuned) / max(m, 1))))]


@functools.lru_cache(maxsize=4096)
def gemm_config(m: int, n: int, k: int, device: torch.device) -> dict:
    """The launch config for ``[m, k] x [n, k]``: the tuned table's (``nearest_tuned``) for this
    (N, K) on this GPU, else ``default_config``; on the CPU (Triton's interpreter) small tiles and
    two K splits, so that test shapes run both paths over several tiles, except for products of at
    least 128 x 256 (a model load's), which take one split of 128 x 256 tiles (minutes otherwise)."""
    if device.type != "cuda":
        if m >= 128 and n >= 256:
            return dict(BLOCK_M=128, BLOCK_N=256, SPLIT_K=1, GROUP_M=2, num_warps=4, num_stages=1)
        return dict(BLOCK_M=16, BLOCK_N=32, SPLIT_K=2 if k > SCALE_BLOCK else 1, GROUP_M=2, num_warps=4, num_stages=1)
    props = torch.cuda.get_device_properties(device)
    by_m = tuned_table("gemm", props.name).get(f"{n},{k}")
    return nearest_tuned(by_m, m) if by_m else default_config(m, n, k, props.multi_processor_count, props.major == 9)


def block_scaled_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    out: torch.Tensor | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """``C = (A * a_scale) @ (B * b_scale).T`` with the scales applied per 128-wide K block.

    Args:
        a: ``[M, K]`` fp8 (E4M3 or E5M2), last dim contiguous.
        a_scale: ``[M, cdiv(K, 128)]`` fp32, one scale per row and K block.
        b: ``[N, K]`` fp8, last dim contiguous (an ``nn.Linear`` weight).
        b_scale: ``[cdiv(N, 128), cdiv(K, 128)]`` fp32, one scale per 128 x 128 block.
        out_dtype: bf16 or fp16. ``out``: optional ``[M, N]`` buffer, last dim contiguous.
        config: launch parameters (``BLOCK_M``, ``BLOCK_N``, ``SPLIT_K``, ``GROUP_M``, ``num_warps``,
            ``num_stages``, optionally ``SWAP_AB``: products as ``B A^T``); default ``gemm_config``, a
            table tuned per GPU and (N, K), then a heuristic (the heuristic's where the table names a Hopper kernel and an operand is not
            E4M3 or its rows are not 16-byte aligned). ``SPLIT_K > 1`` sums fp32 partials in the same
            launch (``sums_in_launch``; ``"SUM_IN_LAUNCH": False`` opts out), else in a second kernel.
            ``"KERNEL": "sm90"`` runs ``gemm_sm90``'s Gluon kernel, ``"sm90_ws"`` the warp-specialized one of
            ``gemm_sm90_ws`` (Hopper; their ``fits`` say which configs; the latter splits K too, each
            split at least one K block: ``gemm_sm90_ws.splits_fit``).

    Returns ``C [M, N]``. Raises ``ValueError`` naming any shape, dtype or layout mismatch.
    """
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"a [M, K] and b [N, K] must share K, got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.dtype not in FP8_DTYPES or b.dtype not in FP8_DTYPES:
        raise ValueError(f"a and b must be fp8, got {a.dtype} and {b.dtype}")
    (m, k), n = a.shape, b.shape[0]
    k_blocks, n_blocks = triton.cdiv(k, SCALE_BLOCK), triton.cdiv(n, SCALE_BLOCK)
    if a_scale.shape != (m, k_blocks) or a_scale.dtype != torch.float32:
        raise ValueError(f"a_scale must be fp32 [{m}, {k_blocks}], got {a_scale.dtype} {tuple(a_scale.shape)}")
    if b_scale.shape != (n_blocks, k_blocks) or b_scale.dtype != torch.float32:
        raise ValueError(f"b_scale must be fp32 [{n_blocks}, {k_blocks}] (128 x 128 blocks), got {b_scale.dtype} {tuple(b_scale.shape)}")
    if a.stride(-1) != 1 or b.stride(-1) != 1 or a_scale.stride(-1) != 1 or b_scale.stride(-1) != 1:
        raise ValueError("a, b and their scales need a contiguous last dimension")
    if out_dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"out_dtype {out_dtype} is not supported: bf16 or fp16 is")
    if out is None:
        out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if m and n:
        if config is None:
            config = gemm_config(m, n, k, a.device)
            if config.get("KERNEL") and not (e4m3_operands(a, b) and aligned_rows(a, b)):
                config = default_config(m, n, k, torch.cuda.get_device_properties(a.device).multi_processor_count)
        _launch(a, a_scale, b, b_scale, out, config)
    return out


def launch_key(m: int, n: int, k: int, device: torch.device) -> tuple:
    """What, besides sizes passed as runtime values, decides the kernels ``block_fp8_linear`` launches for
    ``m`` rows of a CUDA ``[n, k]`` weight and how Triton compiles them, from 16 rows up (where the
    quantizer's row blocks stop growing): ``gemm_config``, ``default_config`` (``block_scaled_gemm``'s
    fallback), whether each sums its K splits in the launch (``sums_in_launch``), and whether ``m`` and ``m * n``
    (the K-split partials' stride) divide by 16. ``common_kernels.fp8.warmup`` runs one batch size of each key."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    configs = gemm_config(m, n, k, device), default_config(m, n, k, sms)
    return (*(json.dumps(c, sort_keys=True) for c in configs), *(sums_in_launch(m, n, c) for c in configs),
            m % 16 == 0, m * n % 16 == 0)


def e4m3_operands(*operands: torch.Tensor) -> bool:
    """Whether every operand is E4M3, the only fp8 format the sm_90 kernels are built and tested for."""
    return all(t.dtype == torch.float8_e4m3fn for t in operands)


def aligned_rows(*operands: torch.Tensor) -> bool:
    """Whether every operand's rows start 16-byte aligned, as the sm_90 kernels' TMA copies read them."""
    return all(t.stride(-2) % 16 == 0 and t.data_ptr() % 16 == 0 for t in operands)


TILE_COUNTERS = 4096  # tiles of one K-split launch that sum in the launch; above it, a second kernel sums
_counters: dict[tuple, torch.Tensor] = {}  # per device and stream, never freed: CUDA graphs keep their address


def sums_in_launch(m: int, n: int, config: dict) -> bool:
    """Whether ``block_scaled_gemm`` with this (Triton kernel) ``config`` sums its K splits in the GEMM's own launch:
    split, at most ``TILE_COUNTERS`` output tiles, and not ``"SUM_IN_LAUNCH": False``."""
    tiles = triton.cdiv(m, config["BLOCK_M"]) * triton.cdiv(n, config["BLOCK_N"])
    return (config.get("SPLIT_K", 1) > 1 and not config.get("KERNEL") and config.get("SUM_IN_LAUNCH", True)
            and tiles <= TILE_COUNTERS)


def tile_counters(device: torch.device) -> torch.Tensor | None:
    """The ``TILE_COUNTERS`` int32 zeros of ``device``'s current stream: launches on one stream run one after
    another, so each finds them zero; kernels on two streams may overlap, so each stream has its own. None while
    the stream captures a CUDA graph before any eager launch made its counters: zeros made in a capture are written
    at that graph's replays only, so another graph captured on the stream could find them unset."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device, stream)
    if key not in _counters:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        _counters[key] = torch.zeros(TILE_COUNTERS, dtype=torch.int32, device=device)
    return _counters[key]


def _launch(a, a_scale, b, b_scale, out, config: dict) -> None:
    (m, k), n = a.shape, b.shape[0]
    if config.get("KERNEL") in ("sm90", "sm90_ws"):
        _launch_sm90(a, a_scale, b, b_scale, out, config)
        return
    split = config["SPLIT_K"]
    counters = tile_counters(a.device) if sums_in_launch(m, n, config) else None
    in_launch = counters is not None  # else a second kernel sums
    partial = out if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=a.device)
    grid = (triton.cdiv(m, config["BLOCK_M"]) * triton.cdiv(n, config["BLOCK_N"]), split)
    _block_scaled_gemm_kernel[grid](
        a, b, partial, a_scale, b_scale, out if in_launch else None, counters,
        m, n, k, a.stride(0), b.stride(0), out.stride(0) if split == 1 else n, partial.stride(0) if split > 1 else 0,
        a_scale.stride(0), b_scale.stride(0), out.stride(0),
        split, BLOCK_K=SCALE_BLOCK, BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"], GROUP_M=config["GROUP_M"],
        SWAP_AB=config.get("SWAP_AB", False), SUM_IN_LAUNCH=in_launch,
        num_warps=config["num_warps"], num_stages=config["num_stages"],
        **({"maxnreg": config["maxnreg"]} if "maxnreg" in config else {}),  # a register cap: more programs an SM
    )
    if split > 1 and not in_launch:
        _sum_splits(partial, out)


def _sum_splits(partial: torch.Tensor, out: torch.Tensor) -> None:
    """``out = partial.sum(0)`` in out's dtype, for fp32 K-split partials ``[SPLIT_K, M, N]``."""
    (split, m, n), block = partial.shape, 1024
    _split_k_sum_kernel[(triton.cdiv(m * n, block),)](partial, out, m, n, out.stride(0), SPLIT_K=split, BLOCK=block)


@functools.cache
def _capability(device_index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def require_sm90(module, config: dict, a: torch.Tensor, b: torch.Tensor) -> None:
    """Refuse, naming the problem, a launch of an sm_90 GEMM kernel (``module``) that could not run:
    a config it does not fit, operands that are not E4M3, a GPU that is not Hopper, operands without
    16-byte aligned rows."""
    if not module.fits(config):
        raise ValueError(f"config {config} does not fit the sm_90 GEMM kernel ({module.__name__}.fits)")
    if not e4m3_operands(a, b):
        raise ValueError(f"the sm_90 GEMM kernels take E4M3 operands, got {a.dtype} and {b.dtype}: use the Triton "
                         "kernel (a config without KERNEL)")
    if a.device.type != "cuda" or _capability(a.device.index)[0] != 9:
        raise ValueError(f"the sm_90 GEMM kernel runs on Hopper GPUs only, not on {a.device}")
    if not aligned_rows(a, b):
        raise ValueError("the sm_90 GEMM kernel copies 16-byte rows: a and b need 16-byte aligned rows "
                         f"(K = {a.shape[1]}, row strides {a.stride(0)} and {b.stride(0)})")


def _launch_sm90(a, a_scale, b, b_scale, out, config: dict) -> None:
    (m, k), n = a.shape, b.shape[0]
    module = gemm_sm90_ws if config["KERNEL"] == "sm90_ws" else gemm_sm90
    split = config.get("SPLIT_K", 1)
    if module is gemm_sm90_ws and module.fits(config) and not module.splits_fit(k, split):
        raise ValueError(f"SPLIT_K={split} leaves a split of K = {k} without a 128-wide block "
                         "(gemm_sm90_ws.splits_fit): use fewer splits")
    require_sm90(module, config, a, b)
    if module is gemm_sm90_ws:
        # with K splits, fp32 partials from registers, summed after
        partial = out if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=a.device)
        c_desc = gemm_sm90_ws.out_descriptor(out, config["BLOCK_N"]) if split == 1 else None
        gemm_sm90_ws.block_scaled_gemm_kernel_sm90_ws[gemm_sm90_ws.grid(m, n, config["BLOCK_N"], a.device,
                                                                        split_k=split)](
            *gemm_sm90_ws.descriptors(a, b, config["BLOCK_N"]), partial, a_scale, b_scale, m, n, k, partial.stride(-2),
            a_scale.stride(0), b_scale.stride(0), BLOCK_N=config["BLOCK_N"], GROUP_M=config["GROUP_M"],
            NUM_STAGES=config["num_stages"], c_desc=c_desc, C_TMA=c_desc is not None, SPLIT_K=split,
            num_warps=config["num_warps"], maxnreg=gemm_sm90_ws.MAXNREG,
        )
        if split > 1:
            _sum_splits(partial, out)
        return
    grid = (triton.cdiv(m, config["BLOCK_M"]) * triton.cdiv(n, config["BLOCK_N"]),)
    gemm_sm90.block_scaled_gemm_kernel_sm90[grid](
        a, b, out, a_scale, b_scale, m, n, k, a.stride(0), b.stride(0), out.stride(0), a_scale.stride(0),
        b_scale.stride(0), BLOCK_K=SCALE_BLOCK, BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"],
        GROUP_M=config["GROUP_M"], NUM_STAGES=config["num_stages"], num_warps=config["num_warps"],
    )
