"""What the block-FP8 warm-up adds to an engine's start-up.

Linears (default): ``warm_up_linear`` per DeepSeek-V3 (N, K) shape at ``--max-tokens`` (vLLM's
``max_num_batched_tokens``): ``warmup_s``, its compiles and one run of each of its ``representative_sizes``;
then ``sweep_s``, a run of every batch size with every kernel compiled, which a warm-up of every size would add.

MoE (``--moe E,H,I,k``): ``warm_up_moe`` for that shape twice in the process (its record of warmed
signatures cleared between), each with the Triton kernels it built and those it loaded from Triton's disk cache
(``counting_compiles``), so that the second run is the launches alone; then each of its sizes timed alone, host
(until ``fused_moe_fp8`` returns) and GPU (until a synchronize), slowest first. Run it twice in separate processes
to see what Triton's disk cache saves.

A process sees each shape first here; Triton's on-disk cache may still hold kernels of earlier runs.

    python -m benchmarks.fp8_warmup_cost --out benchmarks/results/fp8_warmup_cost.json
    python -m benchmarks.fp8_warmup_cost --moe 4,256,128,2 --out moe-warmup.json
"""

import argparse
import json
import time

import torch

from benchmarks.fp8_gemm import SHAPES
from common_kernels.fp8 import block_fp8_linear, fused_moe_fp8, moe, warmup
from common_kernels.fp8.warmup import (
    counting_compiles,
    moe_inputs,
    representative_sizes,
    warm_up_linear,
    warm_up_moe,
)
from common_kernels.guard import fp8_guard


def sweep(x, weight, scale):
    torch.cuda.synchronize()
    start = time.perf_counter()
    for m in range(1, x.shape[0] + 1):
        block_fp8_linear(x[:m], weight, scale)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def linear_rows(max_tokens: int) -> list[dict]:
    rows = []
    for n, k in SHAPES:
        weight = torch.randn(n, k, device="cuda").mul(0.02).to(torch.float8_e4m3fn)
        scale = torch.ones(-(-n // 128), -(-k // 128), device="cuda")
        start = time.perf_counter()
        assert warm_up_linear(weight, scale, max_tokens, torch.bfloat16), "LATENTSPEED_FP8_WARMUP=0 is set"
        warmup_s = time.perf_counter() - start
        x = torch.zeros(max_tokens, k, dtype=torch.bfloat16, device="cuda")
        rows.append(dict(n=n, k=k, max_tokens=max_tokens, warmup_s=warmup_s, sweep_s=sweep(x, weight, scale)))
        print(json.dumps(rows[-1]), flush=True)
        del weight, x
        torch.cuda.empty_cache()
    return rows


def moe_weights(experts: int, hidden: int, inter: int, device) -> tuple:
    """E4M3 weights of unit block scales, ``w13 [E, 2I, H]`` and ``w2 [E, H, I]``, with their scales."""
    w13 = torch.randn(experts, 2 * inter, hidden, device=device).mul(0.02).to(torch.float8_e4m3fn)
    w2 = torch.randn(experts, hidden, inter, device=device).mul(0.02).to(torch.float8_e4m3fn)
    return (w13, torch.ones(experts, -(-2 * inter // 128), -(-hidden // 128), device=device),
            w2, torch.ones(experts, -(-hidden // 128), -(-inter // 128), device=device))


def moe_launch_times(weights: tuple, top_k: int, max_tokens: int) -> list[dict]:
    """Each of ``warm_up_moe``'s sizes run alone, as it runs them (zeros, ids cycling over the experts):
    ``host_s`` until ``fused_moe_fp8`` returns, ``total_s`` until the device is idle; slowest first."""
    w13, w13_scale, w2, w2_scale = weights
    experts, _, hidden = w13.shape
    sync = torch.cuda.synchronize if w13.is_cuda else (lambda: None)
    x, ids, routing = moe_inputs(max_tokens, hidden, top_k, experts, torch.bfloat16, w13.device)
    stats, rows = fp8_guard(w13.device).counters, []
    for m in representative_sizes(max_tokens, lambda m: moe.launch_key(m, top_k, w13, w2)):
        sync()
        start = time.perf_counter()
        fused_moe_fp8(x[:m], w13, w13_scale, w2, w2_scale, routing[:m], ids[:m], stats=stats, check_ids=False)
        host = time.perf_counter()
        sync()
        rows.append(dict(tokens=m, host_s=host - start, total_s=time.perf_counter() - start))
    return sorted(rows, key=lambda row: -row["total_s"])


def moe_report(shape: list[int], max_tokens: int) -> dict:
    experts, hidden, inter, top_k = shape
    weights = moe_weights(experts, hidden, inter, "cuda")
    runs = []
    for _ in range(2):
        warmup._warmed.clear()  # noqa: SLF001 - the second run is to find every kernel compiled already
        start = time.perf_counter()
        with counting_compiles() as compiles:
            assert warm_up_moe(*weights[:2], *weights[2:], top_k, max_tokens, torch.bfloat16), "warm-up is off"
        runs.append(dict(warmup_s=time.perf_counter() - start, built=compiles["built"], loaded=compiles["loaded"],
                         cache_dirs=sorted(compiles["cache_dirs"])))
        print(json.dumps(runs[-1]), flush=True)
    launches = moe_launch_times(weights, top_k, max_tokens)
    return dict(shape=dict(experts=experts, hidden=hidden, inter=inter, top_k=top_k), max_tokens=max_tokens,
                warm_ups=runs, launches=len(launches), launch_total_s=sum(r["total_s"] for r in launches),
                launch_host_s=sum(r["host_s"] for r in launches), slowest=launches[:12])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-tokens", type=int, default=8192)
    parser.add_argument("--moe", help="E,H,I,k: time warm_up_moe for these experts instead of the linears")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    report = {"card": torch.cuda.get_device_name(0), "torch": torch.__version__}
    if args.moe:
        report["moe"] = moe_report([int(v) for v in args.moe.split(",")], args.max_tokens)
    else:
        report["rows"] = linear_rows(args.max_tokens)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
