"""Launches for shapes no tuned table holds, on this GPU: the Hopper default (``default_config(...,
hopper=True)``, ``untuned_config(..., hopper=True)``: the warp-specialized kernels where the H200's tuning
chose them) against the Triton-only default (what operands those kernels cannot take still get).

For each GEMM shape (N, K) and M, and each MoE shape and token count, where the two defaults differ:
both outputs (the GEMM's error against the fp32 product; the MoE's difference between the two), and
both timed as CUDA-graph replays (CUDA-event median, L2 flushed) in the order Triton, Hopper, Hopper,
Triton, so that drift within the run shows. ``triton_over_hopper`` > 1: the Hopper default is faster.

    python -m benchmarks.fp8_untuned --out untuned.jsonl            # DeepSeek-V3 under -tp 8, and unsharded
"""

import argparse
import itertools
import json

import torch
import triton

from benchmarks.fp8_gemm import SHAPES, TP8_SHAPES, shape_arg
from benchmarks.fp8_moe import SHAPES as MOE_SHAPES, expert_weights
from benchmarks.timing import in_cuda_graph
from common_kernels.fp8 import block_scaled_gemm, fused_moe_fp8, quantize_per_token_group
from common_kernels.fp8.gemm import default_config
from common_kernels.fp8.moe import untuned_config
from common_kernels.fp8.reference import block_scaled_gemm_ref, quantize_weight_blocks_ref


def replay_us(fn) -> float:
    return triton.testing.do_bench(in_cuda_graph(fn), warmup=5, rep=30, return_mode="median") * 1e3


def timed_pair(run, triton_launch, hopper_launch) -> dict:
    t = [replay_us(lambda c=c: run(c)) for c in (triton_launch, hopper_launch, hopper_launch, triton_launch)]
    return dict(triton_us=t[0], hopper_us=t[1], hopper_us_2=t[2], triton_us_2=t[3],
                triton_over_hopper=(t[0] + t[3]) / (t[1] + t[2]))


def gemm_rows(shapes, ms, sms):
    for n, k in shapes:
        w, ws = quantize_weight_blocks_ref(torch.randn(n, k, device="cuda") / k**0.5)
        for m in ms:
            triton_launch, hopper_launch = default_config(m, n, k, sms), default_config(m, n, k, sms, hopper=True)
            if triton_launch == hopper_launch:
                continue
            a, a_s = quantize_per_token_group(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
            ref = block_scaled_gemm_ref(a, a_s, w, ws, torch.float32)

            def run(config):
                return block_scaled_gemm(a, a_s, w, ws, config=config)

            errors = {f"rel_err_{name}": ((run(c).float() - ref).norm() / ref.norm()).item()
                      for name, c in (("triton", triton_launch), ("hopper", hopper_launch))}
            yield dict(kind="gemm", n=n, k=k, m=m, hopper=hopper_launch, **errors,
                       **timed_pair(run, triton_launch, hopper_launch))


def moe_rows(shapes, token_counts):
    for shape in shapes:
        experts, top_k, hidden, inter = MOE_SHAPES[shape]
        w13, s13 = expert_weights(experts, 2 * inter, hidden)
        w2, s2 = expert_weights(experts, hidden, inter)
        for tokens in token_counts:
            rows_per_expert = tokens * top_k / experts
            triton_launch, hopper_launch = untuned_config(rows_per_expert), untuned_config(rows_per_expert, hopper=True)
            if triton_launch == hopper_launch:
                continue
            x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
            weights, ids = torch.softmax(torch.randn(tokens, experts, device="cuda"), -1).topk(top_k, dim=-1)
            ids = ids.to(torch.int32)

            def run(config):
                return fused_moe_fp8(x, w13, s13, w2, s2, weights, ids, check_ids=False, config=config)

            a, b = run(triton_launch).float(), run(hopper_launch).float()
            yield dict(kind="moe", shape=shape, tokens=tokens, hopper=hopper_launch,
                       rel_diff=((a - b).norm() / a.norm()).item(), **timed_pair(run, triton_launch, hopper_launch))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gemm-shapes", nargs="*", type=shape_arg, default=TP8_SHAPES + SHAPES, metavar="N,K")
    parser.add_argument("--m", type=int, nargs="+", default=[256, 512, 1024, 4096])
    parser.add_argument("--moe-shapes", nargs="*", default=["deepseek_v3_tp8", "deepseek_v3"], choices=list(MOE_SHAPES))
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096])
    parser.add_argument("--out", required=True, help="JSON lines, one a case, after a line naming the card")
    args = parser.parse_args()
    props = torch.cuda.get_device_properties(0)
    with open(args.out, "w") as out:
        print(json.dumps(dict(card=props.name, torch=torch.__version__, triton=triton.__version__)), file=out)
        for row in itertools.chain(gemm_rows(args.gemm_shapes, args.m, props.multi_processor_count),
                                   moe_rows(args.moe_shapes, args.tokens)):
            print(json.dumps(row), flush=True)
            print(json.dumps(row), file=out, flush=True)


if __name__ == "__main__":
    main()
