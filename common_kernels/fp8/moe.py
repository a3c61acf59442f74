"""Block-FP8 fused mixture of experts (DeepSeek-V3's routed experts, W8A8)::

    out[t] = sum_j  w[t, j] * E_{e[t, j]}(x[t])
    E_e(x) = W2_e (silu(W1_e x) * (W3_e x)),   W13_e = [W1_e; W3_e]  [2I, H],   W2_e  [H, I]

``W13 [E, 2I, H]`` and ``W2 [E, H, I]`` are E4M3 with one fp32 scale per 128 x 128 block; ``x`` and
the intermediate are quantized per token and 128 columns before their GEMM (``quantize_per_token_group``).
Routing comes from the caller (``topk_ids``, ``topk_weights [T, k]``); shared experts are extra
experts that every token takes (``append_shared_experts``).

Work split: the ``T * k`` (token, slot) pairs are sorted by expert and each expert's run padded to
``BLOCK_M`` rows (``align_by_expert``, static shapes, so CUDA graphs can capture it), and each
program multiplies one ``BLOCK_M`` run of one expert by a ``BLOCK_N`` slice of that expert's
weights, block scales applied per 128-wide K block as in ``block_scaled_gemm``. The first GEMM
computes the gate and up slices together and stores ``silu(gate) * up`` only: where its tiles hold
whole 128-column groups (``BLOCK_N`` a multiple of 128) already quantized for the second GEMM, in
its epilogue (the values x's dtype would hold, then ``quantize_per_token_group``'s arithmetic, bit
for bit), else in x's dtype for ``quantize_per_token_group``. Or (``SEPARATE_ACT``) it is a plain
grouped GEMM over ``W13`` whose ``[P, 2I]`` gate and up products, in x's dtype, go through
``silu_mul_group_quant`` (vLLM's roundings: gate and up rounded to x's dtype before the activation);
this lets the wide tiles of the second GEMM's kernels compute the first. The second
multiplies by the routing weight before storing each slot's output in x's dtype, and the ``k``
slots of a token are then gathered and summed with fp32 accumulation (``sum_slots``; x's dtype
stored, half the bytes of fp32 slot outputs: at DeepSeek-V3 sizes and 4096 tokens an fp32 version's
sum took 270 us). Both GEMMs store at the sorted rows, so the second reads its A rows and writes
its output in runs of whole rows (the layout a TMA copy takes); only the first gathers tokens.
"""

import functools
import json
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..fp8_format import FP8_DTYPES, fp8_finite_max
from . import gemm_sm90_ws, moe_sm90_ws
from .gemm import SCALE_BLOCK, aligned_rows, e4m3_operands, nearest_tuned, require_sm90, tuned_table
from .moe_sm90_ws import silu_gate
from .quant import (
    GROUP_BLOCK_ROWS,
    QUANT_EPS,
    add_nonfinite,
    group_tile,
    quantize_groups,
    quantize_per_token_group,
)
from .silu_mul_quant import silu_mul_group_quant

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
BLOCK_M = 16 if _INTERPRET else 64
# The launch of both GEMMs: ``BLOCK_M`` (the alignment of each expert's run) and, per GEMM
# (``gate_up``, ``down``), ``BLOCK_N``, ``num_warps`` and ``num_stages``; either may also name
# ``"KERNEL": "sm90_ws"``, a warp-specialized Hopper kernel: ``moe_sm90_ws`` for gate/up (64-row tiles,
# ``BLOCK_N`` 128), ``gemm_sm90_ws`` grouped by expert for down (128-row runs); a Triton launch may set
# ``"SWAP_AB": True``, products as B A^T (runs under 64 rows then reach Hopper's wgmma). A gate/up launch
# with ``"SEPARATE_ACT": True`` runs the down GEMM's kernel (Triton, or ``gemm_sm90_ws`` with 128-row runs)
# over W13 and activates and quantizes its bf16/fp16 products separately (module docstring).
DEFAULT_CONFIG = {
    "BLOCK_M": BLOCK_M,
    "gate_up": {"BLOCK_N": 32 if _INTERPRET else 128, "num_warps": 4, "num_stages": 1 if _INTERPRET else 3},
    "down": {"BLOCK_N": 32 if _INTERPRET else 128, "num_warps": 4, "num_stages": 1 if _INTERPRET else 3},
}


@functools.lru_cache(maxsize=4096)
def moe_config(tokens: int, top_k: int, experts: int, hidden: int, inter: int, device: torch.device) -> dict:
    """The launch config for ``tokens`` routed to ``top_k`` of ``experts`` of ``[2 * inter, hidden]``:
    the tuned table's entry for this shape on this GPU at the nearest token count, else ``untuned_config``;
    ``DEFAULT_CONFIG`` on the CPU (Triton's interpreter)."""
    if device.type != "cuda":
        return DEFAULT_CONFIG
    props = torch.cuda.get_device_properties(device)
    by_tokens = tuned_table("moe", props.name).get(f"{experts},{hidden},{inter},{top_k}")
    return nearest_tuned(by_tokens, tokens) if by_tokens else untuned_config(tokens * top_k / experts, props.major == 9)


def untuned_config(rows_per_expert: float, hopper: bool = False) -> dict:
    """The launch for a shape with no tuned entry, from what tuning chose on the H200 for DeepSeek-V3's
    and a small model's experts: 16-row runs and 64-wide tiles while experts see few rows each
    (decode, small batches), 64-row runs with a 128-wide down GEMM beyond.

    ``hopper`` (an sm_90 GPU, weights the warp-specialized kernels take): from 128 rows an expert, 128-row
    runs with both GEMMs warp-specialized, 1.12-1.29x the Triton launch's speed there on the H200; at 32
    and 64 rows they were 0.92-1.06x, so fewer rows keep the Triton launch (results/fp8-h200-2026-12-05.md)."""
    if rows_per_expert <= 16:
        return {"BLOCK_M": 16, "gate_up": {"BLOCK_N": 64, "num_warps": 8, "num_stages": 4},
                "down": {"BLOCK_N": 64, "num_warps": 4, "num_stages": 4}}
    if hopper and rows_per_expert >= 128:
        return {"BLOCK_M": 128, "gate_up": {"KERNEL": "sm90_ws", "BLOCK_N": 128, "num_warps": 4, "num_stages": 4},
                "down": {"KERNEL": "sm90_ws", "BLOCK_N": 128, "num_warps": 4, "num_stages": 6}}
    return {"BLOCK_M": 64, "gate_up": {"BLOCK_N": 64, "num_warps": 4, "num_stages": 4},
            "down": {"BLOCK_N": 128, "num_warps": 4, "num_stages": 3}}


def hopper_kernel(stage: str, launch: dict):
    """The module of the warp-specialized Hopper kernel that a launch of ``stage`` (``gate_up`` or ``down``)
    runs, whose ``fits`` says which launches it takes; None for a Triton launch."""
    if launch.get("KERNEL") != "sm90_ws":
        return None
    return moe_sm90_ws if stage == "gate_up" and not launch.get("SEPARATE_ACT") else gemm_sm90_ws


ALIGN_MAX_PROGRAMS = 32  # the count and scatter launches' programs; each takes a chunk of >= 1024 pairs
# Up to this many pairs the sort is one launch: on the H200 1.10-1.28x the three launches' speed at 8-512 pairs
# over 256 experts (1.44-1.58x over 8), 0.96-0.97x at 904 pairs (results/fp8-h200-2026-12-05.md)
ONE_LAUNCH_MAX_PAIRS = 512


class ExpertRuns(NamedTuple):
    """The ``T * k`` (token, slot) pairs sorted by expert (``align_by_expert``)."""
    sorted_ids: torch.Tensor  # [P] int32: the pair index t * k + j at each sorted row, T * k for padding
    block_expert: torch.Tensor  # [P // block_m] int32: each block's expert, -1 past the last run
    position: torch.Tensor  # [T * k] int32: each pair's sorted row; >= P for a left-out pair
    used_rows: torch.Tensor  # [1] int32: the rows of all runs, padding included (the rest of P is unused)


def align_programs(pairs: int) -> tuple[int, int]:
    """``align_by_expert``'s pairs a program (``CHUNK``) and programs for ``pairs`` pairs."""
    chunk = max(1024, triton.next_power_of_2(triton.cdiv(pairs, ALIGN_MAX_PROGRAMS)))
    return chunk, max(1, triton.cdiv(pairs, chunk))


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M) -> ExpertRuns:
    """Sort the ``T * k`` (token, slot) pairs by expert, each expert's run padded to ``block_m``;
    pairs with a negative id (experts on another rank) are left out.

    Returns ``ExpertRuns`` with ``P = T * k + min(E, T * k) * (block_m - 1)`` rounded up to
    ``block_m`` (at most that many rows of runs: empty experts take none): the runs from row 0, each
    expert's pairs then padding rows up to its next multiple of ``block_m``, and ``position``, the
    inverse of ``sorted_ids``. Within a run the order of the pairs is unspecified (each pair's
    output row does not depend on it). Three launches, no host synchronization, shapes fixed by
    ``T * k`` and ``E``: CUDA graphs capture it. Reference: ``align_by_expert_ref``.

    Work split: each of up to ``ALIGN_MAX_PROGRAMS`` programs counts its chunk of pairs per expert
    (``tl.histogram``, no atomics); one program turns the counts into run starts, each program's
    first row in each run and each block's expert; then each program scatters its pairs, taking
    rows from its own counters, so atomics only meet within a program. Up to ``ONE_LAUNCH_MAX_PAIRS``
    pairs (decode batches), one program does all three in one launch, the phases split by barriers.
    """
    pairs = topk_ids.numel()
    size = triton.cdiv(pairs + min(num_experts, pairs) * (block_m - 1), block_m) * block_m
    chunk, programs = align_programs(pairs)
    e_pad = triton.next_power_of_2(num_experts + 1)  # bin num_experts: the left-out pairs
    ids = topk_ids.contiguous()
    sorted_ids = torch.empty(size + pairs, dtype=torch.int32, device=ids.device)  # left-out pairs: past size
    block_expert = torch.empty(size // block_m, dtype=torch.int32, device=ids.device)
    position = torch.empty(pairs, dtype=torch.int32, device=ids.device)
    used_rows = torch.empty(1, dtype=torch.int32, device=ids.device)
    cursor = torch.empty(programs, e_pad, dtype=torch.int32, device=ids.device)
    if pairs <= ONE_LAUNCH_MAX_PAIRS:
        _align_one_program_kernel[(1,)](ids, cursor, sorted_ids, block_expert, position, used_rows, pairs,
                                        num_experts, size, BLOCK_M=block_m, E_PAD=e_pad, CHUNK=chunk,
                                        BLOCKS_CHUNK=32, num_warps=8)
        return ExpertRuns(sorted_ids[:size], block_expert, position, used_rows)
    _count_by_expert_kernel[(programs,)](ids, cursor, sorted_ids, pairs, num_experts, size, E_PAD=e_pad,
                                         CHUNK=chunk)
    _run_starts_kernel[(1,)](cursor, block_expert, used_rows, programs, num_experts, size, BLOCK_M=block_m,
                             E_PAD=e_pad, P_PAD=triton.next_power_of_2(programs), BLOCKS_CHUNK=32, num_warps=8)
    _scatter_by_expert_kernel[(programs,)](ids, sorted_ids, position, cursor, pairs, num_experts, E_PAD=e_pad,
                                           CHUNK=chunk)
    return ExpertRuns(sorted_ids[:size], block_expert, position, used_rows)


@triton.jit
def _expert_keys(ids_ptr, pairs, num_experts, pid, CHUNK: tl.constexpr):
    """Program ``pid``'s pair indices, whether each is real, and its bin (``num_experts`` if left out)."""
    offs = pid * CHUNK + tl.arange(0, CHUNK)
    in_range = offs < pairs
    key = tl.load(ids_ptr + offs, mask=in_range, other=-1).to(tl.int32)
    return offs, in_range, tl.where(key < 0, num_experts, key)


@triton.jit
def _count_by_expert_kernel(ids_ptr, cursor_ptr, sorted_ids_ptr, pairs, num_experts, size, E_PAD: tl.constexpr,
                            CHUNK: tl.constexpr):
    _count_by_expert(ids_ptr, cursor_ptr, sorted_ids_ptr, pairs, num_experts, size, tl.program_id(0),
                     tl.num_programs(0), E_PAD, CHUNK)


@triton.jit
def _count_by_expert(ids_ptr, cursor_ptr, sorted_ids_ptr, pairs, num_experts, size, pid, programs,
                     E_PAD: tl.constexpr, CHUNK: tl.constexpr):
    """Row ``pid`` of ``cursor``: program ``pid``'s pairs per bin. Also fills this program's share of
    ``sorted_ids[:size]`` with the padding marker (before the scatter overwrites it)."""
    _, in_range, key = _expert_keys(ids_ptr, pairs, num_experts, pid, CHUNK)
    tl.store(cursor_ptr + pid * E_PAD + tl.arange(0, E_PAD), tl.histogram(key, E_PAD, mask=in_range))
    share = tl.cdiv(size, programs)
    for start in range(pid * share, tl.minimum(pid * share + share, size), CHUNK):
        offs = start + tl.arange(0, CHUNK)
        tl.store(sorted_ids_ptr + offs, tl.full([CHUNK], 0, tl.int32) + pairs,
                 mask=(offs < size) & (offs < pid * share + share))


@triton.jit
def _run_starts_kernel(cursor_ptr, block_expert_ptr, used_rows_ptr, programs, num_experts, size,
                       BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, P_PAD: tl.constexpr, BLOCKS_CHUNK: tl.constexpr):
    _run_starts(cursor_ptr, block_expert_ptr, used_rows_ptr, programs, num_experts, size, BLOCK_M, E_PAD, P_PAD,
                BLOCKS_CHUNK)


@triton.jit
def _run_starts(cursor_ptr, block_expert_ptr, used_rows_ptr, programs, num_experts, size, BLOCK_M: tl.constexpr,
                E_PAD: tl.constexpr, P_PAD: tl.constexpr, BLOCKS_CHUNK: tl.constexpr):
    """Counts per program and bin -> each program's first row in each expert's padded run (the
    left-out bin starts at ``size``, past the returned rows), each block's expert and the rows of
    all runs."""
    progs = tl.arange(0, P_PAD)
    experts = tl.arange(0, E_PAD)
    cells = cursor_ptr + progs[:, None] * E_PAD + experts[None, :]
    valid = (progs < programs)[:, None]
    counts_p = tl.load(cells, mask=valid, other=0)  # [P_PAD, E_PAD]
    counts = tl.sum(counts_p, axis=0)
    real = experts < num_experts
    padded = tl.where(real, (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
    ends = tl.cumsum(padded, 0)
    tl.store(used_rows_ptr, tl.sum(padded, 0))
    starts = tl.where(real, ends - padded, size)
    tl.store(cells, starts[None, :] + tl.cumsum(counts_p, 0) - counts_p, mask=valid)
    ends = tl.where(real, ends, size + 1)  # the left-out bin and padding bins never own a block
    for first in range(0, size // BLOCK_M, BLOCKS_CHUNK):
        blocks = first + tl.arange(0, BLOCKS_CHUNK)
        # The block's expert: how many runs end at or before its first row.
        owner = tl.sum((ends[None, :] <= blocks[:, None] * BLOCK_M).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + blocks, tl.where(owner < num_experts, owner, -1), mask=blocks < size // BLOCK_M)


@triton.jit
def _scatter_by_expert_kernel(ids_ptr, sorted_ids_ptr, position_ptr, cursor_ptr, pairs, num_experts,
                              E_PAD: tl.constexpr, CHUNK: tl.constexpr):
    _scatter_by_expert(ids_ptr, sorted_ids_ptr, position_ptr, cursor_ptr, pairs, num_experts, tl.program_id(0),
                       E_PAD, CHUNK)


@triton.jit
def _scatter_by_expert(ids_ptr, sorted_ids_ptr, position_ptr, cursor_ptr, pairs, num_experts, pid,
                       E_PAD: tl.constexpr, CHUNK: tl.constexpr):
    """Each of program ``pid``'s pairs to the next free row of its bin, from that program's own counters."""
    offs, in_range, key = _expert_keys(ids_ptr, pairs, num_experts, pid, CHUNK)
    row = tl.atomic_add(cursor_ptr + pid * E_PAD + key, 1, mask=in_range)
    tl.store(sorted_ids_ptr + row, offs, mask=in_range)
    tl.store(position_ptr + offs, row, mask=in_range)


@triton.jit
def _align_one_program_kernel(ids_ptr, cursor_ptr, sorted_ids_ptr, block_expert_ptr, position_ptr, used_rows_ptr,
                              pairs, num_experts, size, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr,
                              CHUNK: tl.constexpr, BLOCKS_CHUNK: tl.constexpr):
    """The three launches' work for up to ``CHUNK`` pairs in one program, each phase behind a barrier
    (its stores to global memory visible to the program's other threads)."""
    _count_by_expert(ids_ptr, cursor_ptr, sorted_ids_ptr, pairs, num_experts, size, 0, 1, E_PAD, CHUNK)
    tl.debug_barrier()
    _run_starts(cursor_ptr, block_expert_ptr, used_rows_ptr, 1, num_experts, size, BLOCK_M, E_PAD, 1, BLOCKS_CHUNK)
    tl.debug_barrier()
    _scatter_by_expert(ids_ptr, sorted_ids_ptr, position_ptr, cursor_ptr, pairs, num_experts, 0, E_PAD, CHUNK)


def append_shared_experts(topk_ids: torch.Tensor, topk_weights: torch.Tensor, first_shared: int, num_shared: int,
                          weight: float = 1.0):
    """Routing with ``num_shared`` always-taken experts (ids ``first_shared ...``) appended to every
    token, each weighted ``weight`` -- the shared experts' weights follow the routed ones in W13/W2."""
    tokens = topk_ids.shape[0]
    shared = torch.arange(first_shared, first_shared + num_shared, device=topk_ids.device, dtype=topk_ids.dtype)
    ids = torch.cat([topk_ids, shared.expand(tokens, num_shared)], dim=1)
    weights = torch.cat([topk_weights, topk_weights.new_full((tokens, num_shared), weight)], dim=1)
    return ids, weights


@triton.jit
def _moe_gemm_kernel(
    a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, c_ptr, c_scale_ptr, stats_ptr, sorted_ids_ptr, block_expert_ptr,
    weights_ptr, num_pairs, N, K, stride_am, stride_asm, stride_be, stride_bn, stride_bse, stride_bsn, stride_cm,
    stride_csm, eps,
    ROWS_PER_A: tl.constexpr, A_SORTED: tl.constexpr, GATED: tl.constexpr, APPLY_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    QUANT_OUT: tl.constexpr, MID_DTYPE: tl.constexpr, FP8_MAX: tl.constexpr, TRACK_STATS: tl.constexpr,
    ONE_SCALE: tl.constexpr, SWAP_AB: tl.constexpr,
):
    """One ``BLOCK_M`` run of one expert times a ``BLOCK_N`` slice of its weights, stored at the
    run's sorted rows; ``GATED``, padding rows too (as zeros: their A rows load as zeros). A's row of
    each pair: its token (``pair // ROWS_PER_A``), or with ``A_SORTED`` its sorted row (A was stored
    by this kernel). ``GATED``: the weights are ``[gate; up]`` (``2N`` rows) and the output is
    ``silu(gate) * up`` (``N`` columns).
    ``QUANT_OUT`` (``BLOCK_N`` a multiple of ``BLOCK_K``): the output is stored as ``MID_DTYPE`` would
    hold it, quantized per row and ``BLOCK_K`` columns (``c_ptr`` fp8, ``c_scale_ptr`` fp32), as
    ``quantize_per_token_group`` would quantize the stored intermediate. ``ONE_SCALE``: each
    ``BLOCK_N`` slice of weight rows (gate and up) lies in one weight block. ``SWAP_AB``: the products
    are taken as ``B A^T`` (weight rows as the MMA's M, at least 64 on Hopper's wgmma; the run's rows
    as its N, 8 or 16 will do) into ``[BLOCK_N, BLOCK_M]`` sums, transposed once after the K loop."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    sorted_row = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    pair = tl.load(sorted_ids_ptr + sorted_row)
    mask_m = pair < num_pairs
    row = sorted_row if A_SORTED else (pair // ROWS_PER_A).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    a_rows = a_ptr + row[:, None] * stride_am
    a_scales = a_scale_ptr + row * stride_asm
    b_expert = b_ptr + expert * stride_be
    bs_expert = b_scale_ptr + expert * stride_bse
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        acc_up = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        mask_k = kb * BLOCK_K + offs_k < K
        a = tl.load(a_rows + kb * BLOCK_K + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        a_s = tl.load(a_scales + kb, mask=mask_m, other=0.0)
        acc += _block_dot(a, a_s, b_expert, bs_expert, pid_n * BLOCK_N, offs_n, mask_n, offs_k, mask_k, kb,
                          stride_bn, stride_bsn, BLOCK_K, ONE_SCALE, SWAP_AB)
        if GATED:
            acc_up += _block_dot(a, a_s, b_expert, bs_expert, pid_n * BLOCK_N + N, offs_n + N, mask_n, offs_k, mask_k,
                                 kb, stride_bn, stride_bsn, BLOCK_K, ONE_SCALE, SWAP_AB)
    if SWAP_AB:
        acc = tl.trans(acc)
        acc_up = tl.trans(acc_up)
    if GATED:  # padding rows zero, whatever the scales make of their zero A (0 * inf is NaN)
        acc = tl.where(mask_m[:, None], silu_gate(acc, acc_up), 0.0)
    if APPLY_WEIGHT:
        acc *= tl.load(weights_ptr + pair, mask=mask_m, other=0.0)[:, None]
    c = c_ptr + sorted_row[:, None] * stride_cm + offs_n[None, :]
    # the intermediate's padding rows as zeros: the quantizer and the second GEMM read whole runs
    mask_c = ((sorted_row >= 0) if GATED else mask_m)[:, None] & mask_n[None, :]
    if QUANT_OUT:  # as x's dtype would hold it, then quantize_per_token_group's arithmetic
        h = acc.to(MID_DTYPE).to(tl.float32)
        y, scale = quantize_groups(tl.reshape(h, [BLOCK_M, BLOCK_N // BLOCK_K, BLOCK_K]), eps, FP8_MAX, False)
        tl.store(c, tl.reshape(y, [BLOCK_M, BLOCK_N]).to(c_ptr.dtype.element_ty), mask=mask_c)
        groups = pid_n * (BLOCK_N // BLOCK_K) + tl.arange(0, BLOCK_N // BLOCK_K)
        tl.store(c_scale_ptr + sorted_row[:, None] * stride_csm + groups[None, :],
                 tl.reshape(scale, [BLOCK_M, BLOCK_N // BLOCK_K]),
                 mask=(sorted_row >= 0)[:, None] & (groups * BLOCK_K < N)[None, :])
        if TRACK_STATS:
            add_nonfinite(stats_ptr, h, mask_c)
    else:
        tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=mask_c)


@triton.jit
def _block_dot(a, a_s, b_expert, bs_expert, first_row, rows, mask_rows, offs_k, mask_k, kb, stride_bn, stride_bsn,
               BLOCK_K: tl.constexpr, ONE_SCALE: tl.constexpr, SWAP_AB: tl.constexpr):
    """``a @ B[rows, K block kb]^T`` with the activation and weight block scales applied, or with
    ``SWAP_AB`` its transpose ``B[rows, K block kb] @ a^T``; ``rows`` start at ``first_row``, and with
    ``ONE_SCALE`` lie in one weight block: one multiply an output."""
    b = tl.load(b_expert + rows.to(tl.int64)[:, None] * stride_bn + kb * BLOCK_K + offs_k[None, :],
                mask=mask_rows[:, None] & mask_k[None, :], other=0.0)
    if ONE_SCALE:
        a_s = a_s * tl.load(bs_expert + (first_row // BLOCK_K) * stride_bsn + kb)
        if SWAP_AB:
            product = tl.dot(b, tl.trans(a)) * a_s[None, :]
        else:
            product = tl.dot(a, tl.trans(b)) * a_s[:, None]
    else:
        b_s = tl.load(bs_expert + (rows // BLOCK_K).to(tl.int64) * stride_bsn + kb, mask=mask_rows, other=0.0)
        if SWAP_AB:
            product = tl.dot(b, tl.trans(a)) * b_s[:, None] * a_s[None, :]
        else:
            product = tl.dot(a, tl.trans(b)) * a_s[:, None] * b_s[None, :]
    return product


_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def _moe_gemm(a, a_scale, b, b_scale, out, runs: ExpertRuns, num_pairs, weights, top_k, gated, apply_weight,
              launch: dict, out_scale=None, mid_dtype=None, stats=None):
    """``out [P, n]`` at the sorted rows of ``runs``. A's rows: tokens (``top_k`` pairs a token), or
    with ``top_k=None`` sorted rows. ``out_scale`` given: ``out`` (fp8) and ``out_scale`` take the
    output quantized per 128 columns, rounded to ``mid_dtype`` first. ``"KERNEL": "sm90_ws"``: sorted
    A rows, neither ``gated`` nor ``out_scale``."""
    if launch.get("KERNEL") == "sm90_ws":
        _grouped_gemm_sm90_ws(a, a_scale, b, b_scale, out, runs, num_pairs, weights if apply_weight else None,
                              launch)
        return
    n, k = out.shape[1], b.shape[2]
    quant_out = out_scale is not None
    fp8_max = fp8_finite_max(out.dtype) if quant_out else 0.0
    blocks = runs.block_expert.shape[0]
    # Runs are contiguous from block 0 and every run holds at least one of the pairs, so no later
    # block has work: with few tokens this skips most of the padding blocks.
    grid = (min(blocks, num_pairs), triton.cdiv(n, launch["BLOCK_N"]))
    _moe_gemm_kernel[grid](
        a, a_scale, b, b_scale, out, out_scale if quant_out else out, stats if stats is not None else a_scale,
        runs.sorted_ids, runs.block_expert, weights, num_pairs, n, k, a.stride(0), a_scale.stride(0), b.stride(0),
        b.stride(1), b_scale.stride(0), b_scale.stride(1), out.stride(0), out_scale.stride(0) if quant_out else 0,
        QUANT_EPS, ROWS_PER_A=top_k or 1, A_SORTED=top_k is None, GATED=gated, APPLY_WEIGHT=apply_weight,
        BLOCK_M=runs.sorted_ids.shape[0] // blocks, BLOCK_N=launch["BLOCK_N"], BLOCK_K=SCALE_BLOCK,
        QUANT_OUT=quant_out, MID_DTYPE=_TL_DTYPES[mid_dtype] if quant_out else tl.float32, FP8_MAX=fp8_max,
        TRACK_STATS=quant_out and stats is not None,
        # 128-column tiles of 128-aligned gate and up halves: one weight scale a K block (as gemm.py)
        ONE_SCALE=launch["BLOCK_N"] == SCALE_BLOCK and n % SCALE_BLOCK == 0, SWAP_AB=launch.get("SWAP_AB", False),
        num_warps=launch["num_warps"], num_stages=launch["num_stages"],
        **({"maxnreg": launch["maxnreg"]} if "maxnreg" in launch else {}),  # a register cap: more programs an SM
    )


def _grouped_gemm_sm90_ws(a, a_scale, b, b_scale, out, runs: ExpertRuns, num_pairs, weights, launch) -> None:
    """A GEMM over the sorted rows on ``gemm_sm90_ws``'s warp-specialized Hopper kernel, grouped by
    expert: A's sorted rows by bulk tensor copies, each 128-row run's expert's weights, C by bulk
    stores, each row times its pair's routing weight unless ``weights`` is None (the second GEMM, and
    the first with ``SEPARATE_ACT``). With ``weights`` only the pairs' rows of C are stored (``sum_slots``
    reads no other)."""
    block_m = runs.sorted_ids.shape[0] // runs.block_expert.shape[0]
    if block_m != gemm_sm90_ws.BLOCK_M.value:
        raise ValueError(f"the sm90_ws MoE kernel takes runs of {gemm_sm90_ws.BLOCK_M.value} rows: the config's "
                         f"BLOCK_M is {block_m}")
    if not b.is_contiguous():
        raise ValueError("the sm90_ws MoE kernel reads the experts' weights as one [E * N, K] matrix: they must be "
                         f"contiguous, got strides {b.stride()}")
    if launch.get("SPLIT_K", 1) != 1:
        raise ValueError(f"the sm90_ws MoE kernel does not split K: the config's SPLIT_K is {launch['SPLIT_K']}")
    experts, n, k = b.shape
    stacked = b.view(experts * n, k)
    require_sm90(gemm_sm90_ws, dict(launch, BLOCK_M=block_m), a, stacked)
    rows, block_n = out.shape[0], launch["BLOCK_N"]
    c_desc = gemm_sm90_ws.out_descriptor(out, block_n)
    gemm_sm90_ws.block_scaled_gemm_kernel_sm90_ws[gemm_sm90_ws.grid(rows, n, block_n, a.device)](
        *gemm_sm90_ws.descriptors(a, stacked, block_n), out, a_scale, b_scale, rows, n, k,
        out.stride(0), a_scale.stride(0), b_scale.stride(1), BLOCK_N=block_n, GROUP_M=launch.get("GROUP_M", 8),
        NUM_STAGES=launch["num_stages"], c_desc=c_desc, C_TMA=c_desc is not None, rows_in_use_ptr=runs.used_rows,
        block_expert_ptr=runs.block_expert, sorted_ids_ptr=runs.sorted_ids, weights_ptr=weights,
        num_pairs=num_pairs, stride_bse=b_scale.stride(0), GROUPED=True, num_warps=launch["num_warps"],
        maxnreg=gemm_sm90_ws.MAXNREG,
    )


def _moe_gate_up_sm90_ws(a, a_scale, w13, w13_scale, h, h_scale, runs: ExpertRuns, num_pairs, launch, mid_dtype,
                         stats) -> None:
    """The first GEMM on ``moe_sm90_ws``'s warp-specialized Hopper kernel over the sorted A rows
    (``quantize_to_sorted_rows``), ``h`` (E4M3) and ``h_scale`` quantized in its epilogue."""
    block_m = runs.sorted_ids.shape[0] // runs.block_expert.shape[0]
    experts, two_i, hidden = w13.shape
    if block_m % moe_sm90_ws.ROWS.value:
        raise ValueError(f"the sm90_ws gate/up kernel takes runs of a multiple of {moe_sm90_ws.ROWS.value} rows: "
                         f"the config's BLOCK_M is {block_m}")
    if two_i // 2 % SCALE_BLOCK or not w13.is_contiguous():
        raise ValueError("the sm90_ws gate/up kernel needs contiguous W13 and an intermediate size that is a "
                         f"multiple of {SCALE_BLOCK} (each tile's gate and up columns in one weight block), got "
                         f"W13 {tuple(w13.shape)} with strides {w13.stride()}")
    require_sm90(moe_sm90_ws, dict(launch, BLOCK_M=block_m), a, w13[0])
    fp8_max = fp8_finite_max(h.dtype)
    grid = gemm_sm90_ws.grid(h.shape[0], two_i // 2, moe_sm90_ws.BLOCK_N.value, a.device, moe_sm90_ws.ROWS.value)
    moe_sm90_ws.moe_gate_up_kernel_sm90_ws[grid](
        *moe_sm90_ws.descriptors(a, w13), a_scale, w13_scale, h, h_scale, stats if stats is not None else a_scale,
        runs.used_rows, runs.sorted_ids, runs.block_expert, num_pairs, two_i // 2, hidden, a_scale.stride(0),
        w13_scale.stride(0), w13_scale.stride(1), h.stride(0), h_scale.stride(0), QUANT_EPS, RUN_ROWS=block_m,
        GROUP_M=launch.get("GROUP_M", 8), NUM_STAGES=launch["num_stages"], MID_DTYPE=_TL_DTYPES[mid_dtype],
        FP8_MAX=fp8_max, TRACK_STATS=stats is not None,
        num_warps=launch["num_warps"], maxnreg=gemm_sm90_ws.MAXNREG,
    )


@triton.jit
def _quantize_to_sorted_rows_kernel(
    x_ptr, position_ptr, q_ptr, scale_ptr, stats_ptr, tokens, hidden, num_rows, stride_x, stride_q, stride_s, eps,
    TOP_K: tl.constexpr, GROUP: tl.constexpr, FP8_MAX: tl.constexpr, TRACK_STATS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
):
    """One group of ``BLOCK_ROWS`` tokens quantized once, stored at each of their pairs' sorted rows."""
    rows, group, offs, mask = group_tile(tokens, hidden, GROUP, BLOCK_ROWS)
    x = tl.load(x_ptr + rows[:, None] * stride_x + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    y, scale = quantize_groups(x, eps, FP8_MAX, False)
    y = y.to(q_ptr.dtype.element_ty)
    for j in tl.static_range(TOP_K):
        dest = tl.load(position_ptr + rows * TOP_K + j, mask=rows < tokens, other=num_rows).to(tl.int64)
        taken = (dest < num_rows)[:, None]
        tl.store(q_ptr + dest[:, None] * stride_q + offs[None, :], y, mask=mask & taken)
        tl.store(scale_ptr + dest[:, None] * stride_s + group, scale, mask=taken)
    if TRACK_STATS:
        add_nonfinite(stats_ptr, x, mask)


def quantize_to_sorted_rows(x: torch.Tensor, runs: ExpertRuns, top_k: int, stats: torch.Tensor | None = None):
    """``quantize_per_token_group(x, 128)`` (the same values and scales, E4M3), each token's row stored
    at the sorted rows of its ``top_k`` pairs: ``(q [P, H], scales [P, cdiv(H, 128)])`` with
    ``P = runs.sorted_ids.shape[0]``. Rows of no pair (padding, past the runs, left-out pairs) are not
    written. Non-finite inputs are counted once into ``stats[1]``. Reference: ``quantize_to_sorted_rows_ref``."""
    tokens, hidden = x.shape
    rows, groups = runs.sorted_ids.shape[0], triton.cdiv(hidden, SCALE_BLOCK)
    q = torch.empty(rows, hidden, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(rows, groups, dtype=torch.float32, device=x.device)
    fp8_max = fp8_finite_max(q.dtype)
    block_rows = min(GROUP_BLOCK_ROWS, triton.next_power_of_2(tokens))
    _quantize_to_sorted_rows_kernel[(triton.cdiv(tokens, block_rows), groups)](
        x, runs.position, q, scales, stats if stats is not None else scales, tokens, hidden, rows, x.stride(0),
        q.stride(0), scales.stride(0), QUANT_EPS, TOP_K=top_k, GROUP=SCALE_BLOCK, FP8_MAX=fp8_max,
        TRACK_STATS=stats is not None, BLOCK_ROWS=block_rows,
    )
    return q, scales


SUM_BLOCK_H = 64 if _INTERPRET else 1024  # columns a program of ``sum_slots``


@triton.jit
def _sum_slots_kernel(rows_ptr, position_ptr, out_ptr, num_rows, H, stride_r, stride_o, TOP_K: tl.constexpr,
                      K_PAD: tl.constexpr, BLOCK_H: tl.constexpr):
    """``BLOCK_H`` columns of one token's output: its slots' rows summed in fp32."""
    token = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    slot = tl.arange(0, K_PAD)
    row = tl.load(position_ptr + token * TOP_K + slot, mask=slot < TOP_K, other=num_rows).to(tl.int64)
    mask = (row < num_rows)[:, None] & (offs_h < H)[None, :]
    slots = tl.load(rows_ptr + row[:, None] * stride_r + offs_h[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * stride_o + offs_h, tl.sum(slots, 0).to(out_ptr.dtype.element_ty), mask=offs_h < H)


def sum_slots(rows: torch.Tensor, position: torch.Tensor, tokens: int, top_k: int) -> torch.Tensor:
    """``out[t] = sum_j rows[position[t * k + j]]`` (fp32 sums, ``rows``' dtype out): each token's
    ``top_k`` slot outputs gathered from their sorted rows; a position ``>= rows.shape[0]`` (a pair
    left out) adds nothing. Reference: ``sum_slots_ref``."""
    out = rows.new_empty(tokens, rows.shape[1])
    grid = (tokens, triton.cdiv(rows.shape[1], SUM_BLOCK_H))
    _sum_slots_kernel[grid](rows, position, out, rows.shape[0], rows.shape[1], rows.stride(0), out.stride(0),
                            TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), BLOCK_H=SUM_BLOCK_H)
    return out


def _gated_intermediate(x, w13, w13_scale, runs: ExpertRuns, top_k, weights, launch: dict, stats):
    """``silu(gate) * up`` at the sorted rows, quantized per row and 128 columns: ``(h [P, I] E4M3,
    h_scale)``; the quantization is fused into the first GEMM where its tiles hold whole groups
    (and ``SEPARATE_ACT`` is not set)."""
    (pairs, inter), rows = (runs.position.shape[0], w13.shape[1] // 2), runs.sorted_ids.shape[0]
    sorted_a = launch.get("KERNEL") == "sm90_ws"  # A by bulk copies: x quantized into the sorted rows
    if sorted_a:
        a, a_scale = quantize_to_sorted_rows(x, runs, top_k, stats)
    else:
        a, a_scale = quantize_per_token_group(x, SCALE_BLOCK, stats=stats)
    if launch.get("SEPARATE_ACT"):
        gate_up = x.new_empty(rows, 2 * inter)
        _moe_gemm(a, a_scale, w13, w13_scale, gate_up, runs, pairs, weights, None if sorted_a else top_k, False, False,
                  launch)
        return silu_mul_group_quant(gate_up, SCALE_BLOCK, stats=stats, rows_limit=runs.used_rows,
                                    pair_ids=(runs.sorted_ids, pairs))
    if sorted_a:
        h, h_scale = _empty_intermediate(rows, inter, x.device)
        _moe_gate_up_sm90_ws(a, a_scale, w13, w13_scale, h, h_scale, runs, pairs, launch, x.dtype, stats)
        return h, h_scale
    if launch["BLOCK_N"] % SCALE_BLOCK == 0:
        h, h_scale = _empty_intermediate(rows, inter, x.device)
        _moe_gemm(a, a_scale, w13, w13_scale, h, runs, pairs, weights, top_k, True, False, launch, out_scale=h_scale,
                  mid_dtype=x.dtype, stats=stats)
        return h, h_scale
    hidden_act = x.new_empty(rows, inter)
    _moe_gemm(a, a_scale, w13, w13_scale, hidden_act, runs, pairs, weights, top_k, True, False, launch)
    # the rows past the runs were never written: the quantizer stops before them
    return quantize_per_token_group(hidden_act, SCALE_BLOCK, stats=stats, rows_limit=runs.used_rows)


def _empty_intermediate(rows: int, inter: int, device: torch.device):
    """Room for the quantized intermediate: E4M3 values and one fp32 scale a row and 128 columns."""
    return (torch.empty(rows, inter, dtype=torch.float8_e4m3fn, device=device),
            torch.empty(rows, triton.cdiv(inter, SCALE_BLOCK), dtype=torch.float32, device=device))


def _hopper_kernels_take(w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether the warp-specialized kernels take these weights: E4M3 (the only format they are built
    for), contiguous (each is read as one ``[E * N, K]`` matrix), 16-byte aligned (TMA), and an
    intermediate size that is a multiple of 128 (a gate/up tile's columns in one weight block)."""
    return (e4m3_operands(w13, w2) and aligned_rows(w13, w2) and w13.is_contiguous() and w2.is_contiguous()
            and w2.shape[-1] % SCALE_BLOCK == 0)


def launch_config(tokens: int, top_k: int, w13: torch.Tensor, w2: torch.Tensor) -> dict:
    """``fused_moe_fp8``'s default launch: ``moe_config``, or ``untuned_config`` where that names a Hopper
    kernel and ``_hopper_kernels_take`` says no to these weights."""
    experts, two_i, hidden = w13.shape
    config = moe_config(tokens, top_k, experts, hidden, two_i // 2, w13.device)
    if (config["gate_up"].get("KERNEL") or config["down"].get("KERNEL")) and not _hopper_kernels_take(w13, w2):
        return untuned_config(tokens * top_k / experts)
    return config


def launch_key(tokens: int, top_k: int, w13: torch.Tensor, w2: torch.Tensor) -> tuple:
    """What, besides sizes passed as runtime values, decides the kernels ``fused_moe_fp8`` launches for
    ``tokens`` tokens and how Triton compiles them, from 16 tokens up (where the quantizers' row blocks stop
    growing): the launch config, the sort's launches (one program, or ``align_programs``' chunk and its
    padded program count) and whether the token and pair counts divide by 16 (the sorted row counts are
    multiples of ``BLOCK_M``). ``common_kernels.fp8.warmup`` runs one batch size of each key."""
    pairs = tokens * top_k
    chunk, programs = align_programs(pairs)
    return (json.dumps(launch_config(tokens, top_k, w13, w2), sort_keys=True), pairs <= ONE_LAUNCH_MAX_PAIRS, chunk,
            triton.next_power_of_2(programs), tokens % 16 == 0, pairs % 16 == 0)


def _validate(x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, expert_map, check_ids):
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"x must be bf16/fp16 [T, H], got {x.dtype} {tuple(x.shape)}")
    if w13.dtype not in FP8_DTYPES or w2.dtype not in FP8_DTYPES or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"w13 [E, 2I, H] and w2 [E, H, I] must be fp8, got {w13.dtype} {tuple(w13.shape)} and "
                         f"{w2.dtype} {tuple(w2.shape)}")
    experts, two_i, hidden = w13.shape
    if x.shape[1] != hidden or two_i % 2 or w2.shape != (experts, hidden, two_i // 2):
        raise ValueError(f"shapes disagree: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}")
    for name, w, s in (("w13_scale", w13, w13_scale), ("w2_scale", w2, w2_scale)):
        expected = (experts, triton.cdiv(w.shape[1], SCALE_BLOCK), triton.cdiv(w.shape[2], SCALE_BLOCK))
        if tuple(s.shape) != expected or s.dtype != torch.float32 or s.stride(-1) != 1:
            raise ValueError(f"{name} must be fp32 {list(expected)} (128 x 128 blocks, last dimension contiguous), "
                             f"got {s.dtype} {list(s.shape)} with strides {s.stride()}")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids and topk_weights must both be [T, k] with T = {x.shape[0]}, got "
                         f"{tuple(topk_ids.shape)} and {tuple(topk_weights.shape)}")
    if expert_map is not None and (expert_map.dim() != 1 or expert_map.dtype.is_floating_point):
        raise ValueError(f"expert_map must be an integer [E_global] tensor, got {expert_map.dtype} "
                         f"{tuple(expert_map.shape)}")
    id_range = experts if expert_map is None else expert_map.numel()
    if check_ids and topk_ids.numel() and (int(topk_ids.min()) < 0 or int(topk_ids.max()) >= id_range):
        raise ValueError(f"topk_ids must lie in [0, {id_range}), got [{int(topk_ids.min())}, {int(topk_ids.max())}]")


def fused_moe_fp8(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                  w2_scale: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  stats: torch.Tensor | None = None, expert_map: torch.Tensor | None = None,
                  check_ids: bool = True, config: dict | None = None) -> torch.Tensor:
    """The routed experts' output (module docstring).

    Args:
        x: ``[T, H]`` bf16/fp16 hidden states.
        w13: ``[E, 2I, H]`` fp8, gate rows then up rows of each expert; ``w13_scale``
            ``[E, cdiv(2I, 128), cdiv(H, 128)]`` fp32.
        w2: ``[E, H, I]`` fp8; ``w2_scale`` ``[E, cdiv(H, 128), cdiv(I, 128)]`` fp32.
        topk_weights: ``[T, k]`` routing weights (any float dtype); ``topk_ids``: ``[T, k]`` expert ids.
        stats: optional int32 ``[2]`` fp8 guard counters (clamped, non-finite) for the quantizers.
        expert_map: expert parallelism: ``[E_global]`` int, the local index of each global expert
            (``topk_ids`` are then global) or ``-1`` for an expert on another rank, whose pairs
            contribute nothing here.
        check_ids: check that ``topk_ids`` are in range (a device synchronization: engines, whose
            routers produce valid ids and which capture this in CUDA graphs, pass False).
        config: the launch (``DEFAULT_CONFIG``'s keys); default ``moe_config``, tuned per GPU and shape
            (``untuned_config`` where that names a Hopper kernel and the weights are not E4M3, contiguous
            and 16-byte aligned).

    Returns ``[T, H]`` in x's dtype. Raises ``ValueError`` naming any shape, dtype or id problem.
    """
    _validate(x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, expert_map, check_ids)
    tokens, top_k = topk_ids.shape
    experts, _, hidden = w13.shape
    if tokens == 0:
        return x.new_zeros(tokens, hidden)
    if config is None:
        config = launch_config(tokens, top_k, w13, w2)
    ids = topk_ids if expert_map is None else expert_map[topk_ids.long()]
    runs = align_by_expert(ids, experts, config["BLOCK_M"])
    weights = topk_weights.flatten().float().contiguous()
    h, h_scale = _gated_intermediate(x.contiguous(), w13, w13_scale, runs, top_k, weights, config["gate_up"], stats)
    down = torch.empty(runs.sorted_ids.shape[0], hidden, dtype=x.dtype, device=x.device)
    _moe_gemm(h, h_scale, w2, w2_scale, down, runs, tokens * top_k, weights, None, False, True, config["down"])
    return sum_slots(down, runs.position, tokens, top_k)  # pairs left out (expert_map) add nothing
