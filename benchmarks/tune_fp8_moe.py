"""Tune latentspeed's block-FP8 fused MoE for this GPU: the fastest launch per expert shape and token count.

For each shape of ``fp8_moe.SHAPES`` and each token count, every ``BLOCK_M`` (the alignment of each
expert's run) is tried with every launch of the gate/up GEMM (``BLOCK_N``, warps, stages) under the
default down GEMM, then every launch of the down GEMM under that ``BLOCK_M``'s best gate/up one (``search``);
for runs of fewer than ``SWAP_BELOW_BLOCK_M`` rows each launch also as ``B A^T`` products (``SWAP_AB``); up to
``NARROW_UP_TO_TOKENS`` tokens, 16- and 32-wide tiles too (``NARROW_LAUNCHES``); from ``CAPPED_FROM_TOKENS``
tokens on, some under register caps (``maxnreg``: more programs a multiprocessor), and on Hopper from
``WS_FROM_TOKENS`` on the warp-specialized kernels (``WS_LAUNCHES``, at the run lengths they take); where the
winner runs them, their tile order last (``GROUP_M`` of ``WS_GROUP_M`` against the default 8). Each
candidate's output is checked against the default launch's, and its CUDA-graph replay timed (the way engines
run it; median, L2 flushed). The winners are written as the table ``common_kernels.fp8.moe`` reads
(``configs/moe_<GPU name>.json``, or the file ``LATENTSPEED_FP8_MOE_CONFIGS`` names), with the
time of each winner and of the default.

    python -m benchmarks.tune_fp8_moe --out common_kernels/fp8/configs/moe_NVIDIA_H200.json
"""

import argparse
import itertools
import sys
import time

import torch
import triton

from benchmarks.fp8_moe import SHAPES, expert_weights
from benchmarks.timing import in_cuda_graph
from benchmarks.tune_fp8_gemm import SWAP_BELOW_BLOCK_M
from benchmarks.tuned_tables import starting_configs, write_tuned_table
from common_kernels.fp8 import fused_moe_fp8
from common_kernels.fp8.moe import DEFAULT_CONFIG, hopper_kernel

GEMM_LAUNCHES = [{"BLOCK_N": n, "num_warps": w, "num_stages": s} for n, w, s in itertools.product((64, 128), (4, 8), (2, 3, 4))]
# From this many tokens on (enough tiles to fill more programs), the 128-column launches of two or three
# stages are also tried under a register cap. ptxas for sm_90a gives these GEMMs 178-255 registers a thread,
# so a multiprocessor holds two programs of 4 warps or one of 8. With 168 (4 warps) it holds three, and with
# 128 (8 warps) two, at 0-300 bytes of spills at the BLOCK_M they fit (benchmarks/hopper_compile.py's
# "capped" moe reports).
CAPPED_FROM_TOKENS = 1024
# Up to this many tokens, narrow tiles too, for the gate/up GEMM's sake: a gate/up program covers BLOCK_N columns
# of gate and of up, so at one token of DeepSeek-V3 under -tp 8 (8 experts, I = 256) 64-wide tiles make 32
# programs for the H200's 132 SMs, 16-wide ones 128 (vLLM's H200 table takes 32-wide tiles of its [2I] product
# there: 128 programs). Compiled for sm_90a: 70-80 registers, no spills, 18-51 KiB of shared memory at 4-6
# stages; the CPU tests run 16- and 32-wide launches in the interpreter.
NARROW_UP_TO_TOKENS = 64
NARROW_LAUNCHES = [{"BLOCK_N": n, "num_warps": 4, "num_stages": s} for n, s in itertools.product((16, 32), (4, 6))]
# The warp-specialized Hopper kernels (sm_90 only), from this many tokens on, at the run lengths they take
# (``moe.hopper_kernel(...).fits``): gate/up on moe_sm90_ws (64-row tiles; up to 5 stages of 40 KiB fit), or
# with SEPARATE_ACT on gemm_sm90_ws (128-row runs; bf16 products, then silu_mul_group_quant), down on
# gemm_sm90_ws grouped by expert (128-row runs).
WS_FROM_TOKENS = 256
_WS_GEMMS = [{"KERNEL": "sm90_ws", "BLOCK_N": n, "num_warps": 4, "num_stages": s}
             for n, s in itertools.product((128, 64), (4, 6))]
WS_LAUNCHES = {
    "gate_up": [{"KERNEL": "sm90_ws", "BLOCK_N": 128, "num_warps": 4, "num_stages": s} for s in (3, 4, 5)]
    + [dict(launch, SEPARATE_ACT=True) for launch in _WS_GEMMS],
    "down": _WS_GEMMS,
}

# The warp-specialized kernels' tile order (gemm_sm90.grouped_tile: GROUP_M row blocks of tiles in turn), set on
# both GEMMs of a winner that runs them. On the H100 at DeepSeek-V3's 1024 and 4096 tokens 2 and 4 beat the
# default 8 by 1.5 % and 1.8 %, and 1 was 1.4-1.5x slower (results/fp8-moe-padding-h100-2026-12-05.md).
WS_GROUP_M = (1, 2, 4, 16)


def with_group_m(config: dict, group_m: int) -> dict:
    """``config`` with ``GROUP_M`` set on its warp-specialized launches (the Triton ones have no tile order)."""
    return dict(config, **{stage: dict(config[stage], GROUP_M=group_m) for stage in ("gate_up", "down")
                           if config[stage].get("KERNEL") == "sm90_ws"})


def gemm_launches(tokens: int, stage: str, block_m: int):
    yield from GEMM_LAUNCHES
    if tokens <= NARROW_UP_TO_TOKENS:
        yield from NARROW_LAUNCHES
    if block_m < SWAP_BELOW_BLOCK_M:
        for launch in GEMM_LAUNCHES:
            yield dict(launch, SWAP_AB=True)
    if tokens >= CAPPED_FROM_TOKENS:
        for launch in GEMM_LAUNCHES:
            if launch["BLOCK_N"] == 128 and launch["num_stages"] <= 3:
                yield dict(launch, maxnreg=168 if launch["num_warps"] == 4 else 128)
    if tokens >= WS_FROM_TOKENS and torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        for launch in WS_LAUNCHES[stage]:
            if hopper_kernel(stage, launch).fits(dict(launch, BLOCK_M=block_m)):
                yield launch


def time_config(run, config, reference):
    try:
        out = run(config)
    except Exception as exc:  # e.g. triton's OutOfResources for large tiles with many stages
        print(f"  skip {config}: {type(exc).__name__}", file=sys.stderr)
        return None
    err = ((out.float() - reference).norm() / reference.norm()).item()
    if not err < 1e-2:
        raise SystemExit(f"launch {config} disagrees with the default launch: relative difference {err:.3g}")
    return triton.testing.do_bench(in_cuda_graph(lambda: run(config)), warmup=5, rep=20, return_mode="median") * 1e3


def tune_one(tokens, experts, top_k, hidden, inter, w13, s13, w2, s2) -> dict:
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    weights, ids = torch.softmax(torch.randn(tokens, experts, device="cuda"), -1).topk(top_k, dim=-1)
    ids = ids.to(torch.int32)

    def run(config):
        return fused_moe_fp8(x, w13, s13, w2, s2, weights, ids, check_ids=False, config=config)

    # SEPARATE_ACT rounds the intermediate otherwise (gate and up in bf16 first), so its launches are
    # checked against the default launch rounding alike: the fused one differs by fp8 codes flipped
    # in about one value in twenty, 1.5e-2 apart (results/fp8-moe-separate-act-cpu-2026-12-05.md)
    references = {separate: run(dict(DEFAULT_CONFIG, gate_up=dict(DEFAULT_CONFIG["gate_up"], SEPARATE_ACT=separate)))
                  .float() for separate in (False, True)}
    return search(tokens, lambda config: time_config(run, config,
                                                     references[bool(config["gate_up"].get("SEPARATE_ACT"))]))


def search(tokens: int, time_us) -> dict:
    """The fastest launch that ``time_us(config)`` (µs, None for a launch that does not run) finds, one stage
    at a time for each ``BLOCK_M``: gate/up under the default down, then down under this ``BLOCK_M``'s fastest
    gate/up (not the fastest so far at another run length: SEPARATE_ACT over 128-row runs, say, must meet the
    warp-specialized down there, which only 128-row runs take); then, if the fastest runs warp-specialized
    kernels, each ``WS_GROUP_M`` on all of them."""
    best = dict(DEFAULT_CONFIG, us=time_us(DEFAULT_CONFIG))
    default_us = best["us"]
    for block_m in (16, 32, 64, 128):
        gate_up, gate_up_us = DEFAULT_CONFIG["gate_up"], None
        for stage in ("gate_up", "down"):
            base = {"BLOCK_M": block_m, "gate_up": gate_up, "down": DEFAULT_CONFIG["down"]}
            for launch in gemm_launches(tokens, stage, block_m):
                config = dict(base, **{stage: launch})
                us = time_us(config)
                if us is None:
                    continue
                if stage == "gate_up" and (gate_up_us is None or us < gate_up_us):
                    gate_up, gate_up_us = launch, us
                if us < best["us"]:
                    best = dict(config, us=round(us, 2))
    winner = {key: value for key, value in best.items() if key != "us"}
    ws = any(winner[stage].get("KERNEL") == "sm90_ws" for stage in ("gate_up", "down"))
    for group_m in WS_GROUP_M if ws else ():
        config = with_group_m(winner, group_m)
        us = time_us(config)
        if us is not None and us < best["us"]:
            best = dict(config, us=round(us, 2))
    return dict(best, default_us=round(default_us, 2))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 256, 1024, 4096])
    parser.add_argument("--out", required=True)
    parser.add_argument("--update", metavar="TABLE", help="start from this table: the (shape, token count) entries "
                        "not tuned in this run are kept (e.g. the shipped table, retuning a few rows)")
    args = parser.parse_args()
    table, started = starting_configs(args.update), time.perf_counter()
    for shape in args.shapes:
        experts, top_k, hidden, inter = SHAPES[shape]
        w13, s13 = expert_weights(experts, 2 * inter, hidden)
        w2, s2 = expert_weights(experts, hidden, inter)
        for tokens in args.tokens:
            entry = tune_one(tokens, experts, top_k, hidden, inter, w13, s13, w2, s2)
            table.setdefault(f"{experts},{hidden},{inter},{top_k}", {})[str(tokens)] = entry
            print(f"{shape} tokens={tokens}: {entry}", flush=True)
            write_tuned_table(args.out, table, started)  # each entry as it comes: a run cut short keeps them


if __name__ == "__main__":
    main()
