"""Tune latentspeed's block-FP8 GEMM for this GPU: the fastest launch config per (N, K) and M.

For each DeepSeek-V3 linear shape (``fp8_gemm.SHAPES``, or ``--shapes N,K ...``) and each M, every
candidate (tile sizes, pipeline stages, warps, K splits; the space depends on M: split K and
narrow tiles for small M, those of fewer than 64 rows also as ``B A^T`` products (``SWAP_AB``), large
tiles for large M; on Hopper from M = 128 also the Gluon kernels of ``gemm_sm90``, ``"KERNEL":
"sm90"``, and ``gemm_sm90_ws``, ``"KERNEL": "sm90_ws"``, the latter with K splits at M = 64-512) is
compiled, checked against the reference on the same operands, and timed as CUDA-graph replays
(CUDA-event median, L2 flushed before each): the kernel's GPU time, as engines run decode, without
the host's launch time, which swamped the small-M rows when timed eagerly. The winners are written
as the table ``common_kernels.fp8.gemm`` reads
(``configs/gemm_<GPU name>.json``, or the file that ``LATENTSPEED_FP8_GEMM_CONFIGS`` names), with
the time of each winner and of the untuned default.

    python benchmarks/tune_fp8_gemm.py --out common_kernels/fp8/configs/gemm_NVIDIA_H200.json
    python benchmarks/tune_fp8_gemm.py --m 128 256 --update common_kernels/fp8/configs/gemm_NVIDIA_H200.json \
        --out retuned.json                    # two M values again, every other entry as shipped
"""

import argparse
import itertools
import sys
import time

import torch
import triton

from benchmarks.fp8_gemm import SHAPES, shape_arg
from benchmarks.timing import in_cuda_graph
from benchmarks.tuned_tables import starting_configs, write_tuned_table
from common_kernels.fp8 import block_scaled_gemm, gemm_sm90, gemm_sm90_ws, quantize_per_token_group
from common_kernels.fp8.gemm import SCALE_BLOCK, default_config
from common_kernels.fp8.reference import block_scaled_gemm_ref, quantize_weight_blocks_ref

M_VALUES = [1, 16, 64, 128, 256, 512, 4096]
# Tiles of fewer rows are also tried with their products as B A^T (SWAP_AB): Hopper's wgmma takes at least 64
# rows as its M, which the weight's rows then fill, and as few as 8 columns as its N (the activation's rows).
SWAP_BELOW_BLOCK_M = 64
# The warp-specialized kernel's K splits are tried at these M (128-row tiles: from M = 64, half of each
# tile's rows past M, zero-filled by the copies): its 128 x 128 tiles number under the 132 SMs at M = 128
# for N <= 16384 (under 264 with 128 x 64 ones), so a single wave leaves most SMs idle.
WS_SPLIT_M = (64, 512)


def candidates(m: int, k: int):
    k_blocks = triton.cdiv(k, SCALE_BLOCK)
    if m <= 64:
        space = itertools.product([bm for bm in (16, 32, 64) if bm >= min(m, 16) and (bm == 64 or bm >= m)],
                                  (32, 64, 128), (3, 4), (4,), (1, 2, 4, 8, 16))
    elif m <= 256:
        space = [c for c in itertools.product((64, 128), (64, 128, 256), (3, 4), (4, 8), (1, 2, 4))
                 if not (c[0] == 128 and c[1] == 256)]
    else:
        space = itertools.product((64, 128), (128, 256), (3, 4), (4, 8), (1,))
    for bm, bn, stages, warps, split in space:
        if split == 1 or k_blocks // split >= 2:
            config = dict(BLOCK_M=bm, BLOCK_N=bn, SPLIT_K=split, GROUP_M=8, num_warps=warps, num_stages=stages)
            yield config
            if bm < SWAP_BELOW_BLOCK_M and bn >= 64:
                yield dict(config, SWAP_AB=True)
            if m > 256 and (bm, bn, warps, stages) == (64, 128, 4, 3):  # 177 registers: two programs an SM;
                yield dict(config, maxnreg=168)  # capped, three (8 bytes of spills; 72 KiB of shared memory each)
    if m >= 128 and k % 16 == 0 and _on_hopper():  # the Gluon kernel (gemm_sm90)
        for (bm, bn, warps), stages in itertools.product(gemm_sm90.TILES, (4, 5, 6)):
            yield dict(BLOCK_M=bm, BLOCK_N=bn, SPLIT_K=1, GROUP_M=8, num_warps=warps, num_stages=stages, KERNEL="sm90")
        for bn, stages in itertools.product(gemm_sm90_ws.BLOCK_NS, (4, 5, 6)):
            yield ws_config(bn, stages)
    if WS_SPLIT_M[0] <= m <= WS_SPLIT_M[1] and k % 16 == 0 and _on_hopper():
        for split, bn, stages in itertools.product(gemm_sm90_ws.SPLITS[1:], gemm_sm90_ws.BLOCK_NS, (4, 6)):
            if k_blocks // split >= 2:  # two K blocks a split at least (so splits_fit holds)
                yield ws_config(bn, stages, split)


def _on_hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def ws_config(block_n: int, stages: int, split: int = 1) -> dict:
    """A launch of the warp-specialized Gluon kernel (``gemm_sm90_ws``)."""
    return dict(BLOCK_M=gemm_sm90_ws.BLOCK_M.value, BLOCK_N=block_n, SPLIT_K=split, GROUP_M=8,
                num_warps=gemm_sm90_ws.NUM_WARPS.value, num_stages=stages, KERNEL="sm90_ws")


def tune_one(m: int, n: int, k: int, w, ws, sms: int) -> dict:
    a, a_s = quantize_per_token_group(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
    ref = block_scaled_gemm_ref(a, a_s, w, ws, torch.float32)
    best, default = None, default_config(m, n, k, sms, _on_hopper())
    for config in [default, *candidates(m, k)]:
        try:
            out = block_scaled_gemm(a, a_s, w, ws, config=config)
        except Exception as exc:  # e.g. triton's OutOfResources for too many stages of large tiles
            print(f"  skip {config}: {type(exc).__name__}", file=sys.stderr)
            continue
        err = ((out.float() - ref).norm() / ref.norm()).item()
        if not err < 1e-2:
            raise SystemExit(f"config {config} is wrong at m={m} n={n} k={k}: relative error {err:.3g}")
        replay = in_cuda_graph(lambda: block_scaled_gemm(a, a_s, w, ws, config=config))
        us = triton.testing.do_bench(replay, warmup=5, rep=20, return_mode="median") * 1e3
        if config is default:
            default_us = us
        if best is None or us < best["us"]:
            best = dict(config, us=round(us, 2))
    return dict(best, default_us=round(default_us, 2))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", type=shape_arg, default=SHAPES, metavar="N,K")
    parser.add_argument("--m", type=int, nargs="+", default=M_VALUES)
    parser.add_argument("--out", required=True)
    parser.add_argument("--update", metavar="TABLE", help="start from this table: the (shape, M) entries "
                        "not tuned in this run are kept (e.g. the shipped table, retuning a few rows)")
    args = parser.parse_args()
    props = torch.cuda.get_device_properties(0)
    table, started = starting_configs(args.update), time.perf_counter()
    for n, k in args.shapes:
        w, ws = quantize_weight_blocks_ref(torch.randn(n, k, device="cuda") / k**0.5)
        for m in args.m:
            entry = tune_one(m, n, k, w, ws, props.multi_processor_count)
            table.setdefault(f"{n},{k}", {})[str(m)] = entry
            print(f"n={n} k={k} m={m}: {entry}", flush=True)
            write_tuned_table(args.out, table, started)


if __name__ == "__main__":
    main()
