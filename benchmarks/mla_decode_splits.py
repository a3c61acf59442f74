"""MLA decode time against the split count: every power of two up to ``MAX_SPLITS`` that leaves a
split at least 64 tokens, beside the count ``plan_decode`` picks (``auto``). CUDA-graph replays
(medians of ``triton.testing.do_bench``) on ``benchmarks.mla_decode``'s inputs, one JSON row a line.

    python3 benchmarks/mla_decode_splits.py --cache e4m3 --heads 16 --out splits.jsonl
"""

import argparse
import json

import torch
import triton

from benchmarks.mla_decode import D_LATENT, SCALE, make_inputs
from benchmarks.timing import in_cuda_graph
from common_kernels.mla import mla_decode, plan_decode, sm90_kernels_apply
from common_kernels.mla.decode import MAX_SPLITS, MIN_TOKENS_PER_SPLIT

DTYPES = {"bf16": torch.bfloat16, "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def timed(q, cache, table, lens, plan, kv_scale) -> float:
    heads = q.shape[1]
    out = torch.empty(q.shape[0], heads, D_LATENT, dtype=q.dtype, device="cuda")
    lse = torch.empty(q.shape[0], heads, dtype=torch.float32, device="cuda")
    part_out, part_lse = plan.workspace_shapes(D_LATENT)
    ws = (torch.empty(part_out, device="cuda"), torch.empty(part_lse, device="cuda"))
    scale = kv_scale if cache.dtype != torch.bfloat16 else None
    fn = in_cuda_graph(lambda: mla_decode(q[..., :D_LATENT], q[..., D_LATENT:], cache, table, lens, SCALE, plan,
                                          scale, out, lse, ws)[0])
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cache", default="e4m3", choices=list(DTYPES))
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--q-len", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--ctx", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    cache_dtype = DTYPES[args.cache]
    kv_scale = torch.tensor([0.5], device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    sm90 = sm90_kernels_apply(torch.device("cuda"), cache_dtype, 64, D_LATENT, 64)
    with open(args.out, "w") as out:
        for batch in args.batch:
            for q_len in args.q_len:
                for ctx in args.ctx:
                    q, cache, table, lens = make_inputs(batch, args.heads, q_len, ctx, cache_dtype)
                    auto = plan_decode(batch, args.heads, q_len, ctx, sms, cache_dtype=cache_dtype,
                                       sm90=sm90).num_splits
                    splits = 1
                    while splits <= MAX_SPLITS and ctx // splits >= MIN_TOKENS_PER_SPLIT:
                        plan = plan_decode(batch, args.heads, q_len, ctx, sms, num_splits=splits,
                                           cache_dtype=cache_dtype, sm90=sm90)
                        row = dict(cache=args.cache, heads=args.heads, batch=batch, q_len=q_len, ctx=ctx,
                                   splits=splits, auto=auto, us=timed(q, cache, table, lens, plan, kv_scale))
                        out.write(json.dumps(row) + "\n")
                        out.flush()
                        print(json.dumps(row), flush=True)
                        splits *= 2
                    del q, cache, table, lens
                    torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
