"""Host time a call of latentspeed's eager launch paths: MLA decode (batch 128, 16 heads, 4096
tokens; bf16, E4M3 and E5M2 caches; one and two query tokens) and the block-FP8 GEMM at
512 x 4096 x 7168 in each of its kernels, plus the activation quantizer. Each function is called
200 times without synchronizing after 10 warm-up calls; wall time / 200 is the Python launch path
alone, since the GPU runs behind. cProfile of the E4M3 decode and of each GEMM, sorted by own and
by cumulative time, goes beside ``host.json``.

    python -m benchmarks.host_overhead OUT_DIR
"""

import argparse
import cProfile
import io
import json
import pstats
import time

import torch

from benchmarks import mla_decode
from common_kernels.fp8 import block_scaled_gemm, quantize_per_token_group
from common_kernels.fp8.reference import quantize_weight_blocks_ref

CALLS = 200
GEMM_CONFIGS = {
    "table": None,
    "sm90_ws": dict(BLOCK_M=128, BLOCK_N=128, SPLIT_K=1, GROUP_M=8, num_warps=4, num_stages=4, KERNEL="sm90_ws"),
    "sm90": dict(BLOCK_M=128, BLOCK_N=128, SPLIT_K=1, GROUP_M=8, num_warps=8, num_stages=5, KERNEL="sm90"),
    "triton": dict(BLOCK_M=64, BLOCK_N=128, SPLIT_K=1, GROUP_M=8, num_warps=4, num_stages=3),
}


def host_us(fn) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(CALLS):
        fn()
    host = (time.perf_counter() - start) / CALLS * 1e6
    torch.cuda.synchronize()
    return host


def profile(fn, path_prefix: str) -> None:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(CALLS):
        fn()
    profiler.disable()
    torch.cuda.synchronize()
    for key in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(key).print_stats(30)
        with open(f"{path_prefix}_{key}.txt", "w") as f:
            f.write(text.getvalue())


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    out_dir = parser.parse_args().out_dir
    rows = []
    dtypes = {"bf16": torch.bfloat16, "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
    kv_scale = torch.tensor([0.5], device="cuda")
    for cache in dtypes:
        for q_len in (1, 2):
            q, kv, table, lens = mla_decode.make_inputs(128, 16, q_len, 4096, dtypes[cache])
            fn = mla_decode.ours(q, kv, table, lens, q_len, kv_scale)
            rows.append(dict(op="decode", cache=cache, q_len=q_len, host_us=host_us(fn)))
            print(rows[-1], flush=True)
            if cache == "e4m3" and q_len == 1:
                profile(fn, f"{out_dir}/prof_decode_e4m3")
            del q, kv, table, lens, fn
    m, n, k = 512, 4096, 7168
    w, ws = quantize_weight_blocks_ref(torch.randn(n, k, device="cuda") / k**0.5)
    a, a_s = quantize_per_token_group(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
    for name, config in GEMM_CONFIGS.items():
        def fn(config=config):
            return block_scaled_gemm(a, a_s, w, ws, config=config) if config else block_scaled_gemm(a, a_s, w, ws)
        rows.append(dict(op="gemm", m=m, n=n, k=k, config=name, host_us=host_us(fn)))
        print(rows[-1], flush=True)
        profile(fn, f"{out_dir}/prof_gemm_{name}")
    rows.append(dict(op="quantize_per_token_group", m=m, k=k, host_us=host_us(
        lambda: quantize_per_token_group(torch.empty(m, k, device="cuda", dtype=torch.bfloat16)))))
    print(rows[-1], flush=True)
    with open(f"{out_dir}/host.json", "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
