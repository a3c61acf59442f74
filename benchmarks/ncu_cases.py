"""Launches for Nsight Compute: each case runs twice unprofiled (compilation, caches), then once
between ``cudaProfilerStart`` and ``cudaProfilerStop``, so ``ncu --profile-from-start off``
records that launch only. The cases print in order, one line each, to match ncu's report.

    ncu --profile-from-start off --clock-control none --set full --import-source no \\
        -o $OUT/decode python3 -m benchmarks.ncu_cases decode:e4m3:16:1:32768 decode:bf16:16:1:32768 \\
        gemm:4096:7168:2048

Cases: ``decode:CACHE:HEADS:Q_LEN:CTX[:BATCH]`` (batch 128 unless given, ``benchmarks.mla_decode``'s
inputs and plan), ``gemm:M:N:K`` (``block_scaled_gemm`` with its tuned config, E4M3 operands) and
``silu:ROWS:HALF`` (``silu_mul_group_quant`` of a bf16 ``[ROWS, 2 * HALF]``, as after SEPARATE_ACT's products
or a dense MLP's gate/up: ``silu:48128:2048``, ``silu:16384:9216``), ``norm:ROWS:COLS[:stats]``
(``rms_norm_group_quant`` with a residual, with the guard's count when ``stats`` is given) and
``moe:SHAPE:TOKENS[:PROVIDER]`` (one call of ``benchmarks.fp8_moe``'s provider, ``latentspeed`` unless
given, e.g. ``moe:deepseek_v3:1024:vLLM-Triton`` with vLLM on the path; every kernel of the call).

``--set MODULE.NAME=INT`` changes a constant of the sm_90 decode modules while the cases are made and run
(``benchmarks.mla_decode_ab``'s ``--ours-set``): the 64-row kernel's fp8 ``P V`` at batch 1, 512 tokens, where the
plan widens ``V``, is ``--set decode_sm90_seesaw.MIN_TOKENS_PER_FP8_PV_SPLIT=0 -- decode:e4m3:128:1:512:1``.
"""

import argparse

import torch

from benchmarks.mla_decode import make_inputs, ours
from benchmarks.mla_decode_ab import overridden, parse_settings
from benchmarks.mla_decode_splits import DTYPES
from common_kernels.fp8 import (
    block_scaled_gemm,
    fused_moe_fp8,
    quantize_per_token_group,
    quantize_weight_blocks,
    rms_norm_group_quant,
    silu_mul_group_quant,
)

BATCH = 128


def decode_case(cache: str, heads: str, q_len: str, ctx: str, batch: str = str(BATCH)):
    q, cache_t, table, lens = make_inputs(int(batch), int(heads), int(q_len), int(ctx), DTYPES[cache])
    return ours(q, cache_t, table, lens, int(q_len), torch.tensor([0.5], device="cuda"))


def gemm_case(m: str, n: str, k: str):
    a, a_scale = quantize_per_token_group(torch.randn(int(m), int(k), device="cuda", dtype=torch.bfloat16))
    b, b_scale = quantize_weight_blocks(torch.randn(int(n), int(k), device="cuda", dtype=torch.bfloat16) * 0.02)
    return lambda: block_scaled_gemm(a, a_scale, b, b_scale)


def silu_case(rows: str, half: str):
    x = torch.randn(int(rows), 2 * int(half), device="cuda", dtype=torch.bfloat16) * 4
    return lambda: silu_mul_group_quant(x)


def norm_case(rows: str, cols: str, stats: str = ""):
    x, residual = (torch.randn(int(rows), int(cols), device="cuda", dtype=torch.bfloat16) for _ in range(2))
    weight = torch.randn(int(cols), device="cuda", dtype=torch.bfloat16)
    counters = torch.zeros(2, dtype=torch.int32, device="cuda") if stats else None
    return lambda: rms_norm_group_quant(x, weight, 1e-6, residual, stats=counters)


def moe_case(shape: str, tokens: str, provider: str = "latentspeed"):
    from benchmarks import fp8_moe

    _, args = next(fp8_moe.routed_inputs(shape, [int(tokens)]))
    if provider == "vLLM-Triton":
        return fp8_moe.vllm_fused(*args)
    return lambda: fused_moe_fp8(*args, check_ids=False)


CASES = {"decode": decode_case, "gemm": gemm_case, "silu": silu_case, "norm": norm_case, "moe": moe_case}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("cases", nargs="+", help="KIND:ARG:... (see above)")
    parser.add_argument("--set", nargs="+", default=[], metavar="MODULE.NAME=INT",
                        help="a decode module's constant for every case (see above)")
    args = parser.parse_args()
    with overridden(parse_settings(args.set)):
        for case in args.cases:
            kind, *params = case.split(":")
            fn = CASES[kind](*params)
            fn()
            fn()
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStart()
            fn()
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStop()
            print(f"profiled {case}", flush=True)


if __name__ == "__main__":
    main()
