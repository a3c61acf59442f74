"""What the block-FP8 warm-up adds to an engine's start-up: ``warm_up_linear`` per DeepSeek-V3 (N, K)
shape at ``--max-tokens`` (vLLM's ``max_num_batched_tokens``): ``warmup_s``, its compiles and one run of
each of its ``representative_sizes``; then ``sweep_s``, a run of every batch size with every
kernel compiled, which a warm-up of every size would add. A process sees each shape first here; Triton's
on-disk cache may still hold kernels of earlier runs.

    python -m benchmarks.fp8_warmup_cost --out benchmarks/results/fp8_warmup_cost.json
"""

import argparse
import json
import time

import torch

from benchmarks.fp8_gemm import SHAPES
from common_kernels.fp8 import block_fp8_linear
from common_kernels.fp8.warmup import warm_up_linear


def sweep(x, weight, scale):
    torch.cuda.synchronize()
    start = time.perf_counter()
    for m in range(1, x.shape[0] + 1):
        block_fp8_linear(x[:m], weight, scale)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-tokens", type=int, default=8192)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rows = []
    for n, k in SHAPES:
        weight = torch.randn(n, k, device="cuda").mul(0.02).to(torch.float8_e4m3fn)
        scale = torch.ones(-(-n // 128), -(-k // 128), device="cuda")
        start = time.perf_counter()
        assert warm_up_linear(weight, scale, args.max_tokens, torch.bfloat16), "LATENTSPEED_FP8_WARMUP=0 is set"
        warmup_s = time.perf_counter() - start
        x = torch.zeros(args.max_tokens, k, dtype=torch.bfloat16, device="cuda")
        rows.append(dict(n=n, k=k, max_tokens=args.max_tokens, warmup_s=warmup_s, sweep_s=sweep(x, weight, scale)))
        print(json.dumps(rows[-1]), flush=True)
        del weight, x
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"card": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
