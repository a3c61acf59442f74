"""Where an MLA decode step's time goes: the time of each kernel inside the CUDA-graph replay
(``torch.profiler``), and the step itself timed three ways: ``triton.testing.do_bench`` (what
``benchmarks/mla_decode.py`` reports; it zeroes a 256 MB buffer before each replay, which leaves
the L2 full of dirty lines), after a flush by reading 256 MB instead (a clean L2), and with no
flush (the L2 keeps part of the last replay's cache). Batch and inputs as ``benchmarks.mla_decode``'s;
one JSON row a line.

    python3 -m benchmarks.mla_decode_step --heads 16 --q-len 1 2 --ctx 4096 8192 --cache e4m3 bf16 --out step.jsonl
"""

import argparse
import itertools
import json

import torch
import triton
from torch.profiler import ProfilerActivity, profile

from benchmarks.mla_decode import D_LATENT, SCALE, make_inputs
from benchmarks.mla_decode_splits import DTYPES
from benchmarks.timing import in_cuda_graph
from common_kernels.mla import mla_decode, plan_decode, sm90_kernels_apply

FLUSH_BYTES = 256 * 2**20
REPLAYS = 50


def kernel_times(fn) -> dict[str, float]:
    """Mean µs of each kernel over ``REPLAYS`` replays of ``fn``."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(REPLAYS):
            fn()
        torch.cuda.synchronize()
    times = {}
    for event in prof.events():
        if event.device_type.name == "CUDA":
            times.setdefault(event.name, []).append(event.device_time)
    return {name: sum(t) / len(t) for name, t in times.items()}


def step_after(fn, flush) -> float:
    """Median µs of ``fn`` timed by CUDA events, each replay after ``flush()``."""
    times = []
    for _ in range(REPLAYS):
        flush()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--heads", type=int, nargs="+", default=[16])
    parser.add_argument("--q-len", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--ctx", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--cache", nargs="+", default=["e4m3", "bf16"], choices=list(DTYPES))
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    kv_scale = torch.tensor([0.5], device="cuda")
    flush_buffer = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
    with open(args.out, "w") as out:
        for cache_name, heads, q_len, ctx in itertools.product(args.cache, args.heads, args.q_len, args.ctx):
            dtype = DTYPES[cache_name]
            q, cache, table, lens = make_inputs(args.batch, heads, q_len, ctx, dtype)
            sm90 = sm90_kernels_apply(torch.device("cuda"), dtype, 64, D_LATENT, 64)
            plan = plan_decode(args.batch, heads, q_len, ctx, sms, cache_dtype=dtype, sm90=sm90)
            scale = kv_scale if dtype != torch.bfloat16 else None
            fn = in_cuda_graph(lambda: mla_decode(q[..., :D_LATENT], q[..., D_LATENT:], cache, table, lens, SCALE,
                                                  plan, scale)[0])
            for _ in range(10):
                fn()
            row = dict(batch=args.batch, cache=cache_name, heads=heads, q_len=q_len, ctx=ctx, splits=plan.num_splits,
                       kernels_us=kernel_times(fn),
                       step_us_do_bench=triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3,
                       step_us_read_flush=step_after(fn, lambda: flush_buffer.max()),
                       step_us_no_flush=step_after(fn, lambda: None))
            out.write(json.dumps(row) + "\n")
            out.flush()
            print(json.dumps(row), flush=True)
            del q, cache, table, lens


if __name__ == "__main__":
    main()
