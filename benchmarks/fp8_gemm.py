"""Block-scaled fp8 GEMM time: latentspeed (its tuned table's choice; the same with its K splits summed by a
second kernel, where that choice sums them in its launch; the Gluon kernel for Hopper at one config) against
vLLM's Triton, CUTLASS and DeepGEMM kernels, SGLang's Triton and CUTLASS kernels, and bf16 cuBLAS.

DeepSeek-V3's linear shapes (N, K) at M = 1 ... 4096, one process, same weights for everyone:
E4M3 weights with 128 x 128 block scales, activations quantized per 1 x 128 group by each
provider's own quantizer in the layout its GEMM reads (quantization is outside the timed region;
latentspeed's quantizer is timed on its own). CUDA-event medians (``triton.testing.do_bench``,
L2 flushed); with ``--cuda-graph`` each provider's call is one CUDA-graph replay, as engines run
decode, so the host's launch cost drops out. FLOPs = 2·M·N·K. Every output is checked against the
fp32 product of the dequantized operands.

    python benchmarks/fp8_gemm.py --out benchmarks/results/fp8_gemm.json [--providers latentspeed SGLang-Triton ...]

DeepGEMM runs with fp32 scales (``VLLM_USE_DEEP_GEMM_E8M0=0``), as in DeepSeek-V3's checkpoints;
vLLM's default on an H200 would round them to powers of two.
"""

import os

os.environ.setdefault("VLLM_USE_DEEP_GEMM_E8M0", "0")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402

from benchmarks.timing import in_cuda_graph  # noqa: E402
from common_kernels.fp8 import block_scaled_gemm, quantize_per_token_group  # noqa: E402
from common_kernels.fp8.gemm import gemm_config, sums_in_launch  # noqa: E402
from common_kernels.fp8.reference import dequantize_weight_blocks_ref, quantize_weight_blocks_ref  # noqa: E402

SHAPES = [(2112, 7168), (24576, 1536), (32768, 512), (7168, 16384), (4096, 7168), (7168, 2048)]
# The same model's linear layers as each of eight tensor-parallel ranks holds them in vLLM 0.26 (column-parallel
# layers split N eight ways, row-parallel ones K): q_b_proj, kv_b_proj, the dense layers' gate/up and down, the
# shared experts' gate/up and down (o_proj's (7168, 2048) is in SHAPES; fused_qkv_a_proj is replicated)
TP8_SHAPES = [(3072, 1536), (4096, 512), (4608, 7168), (7168, 2304), (512, 7168), (7168, 256)]


def shape_arg(text: str) -> tuple[int, int]:
    """An ``N,K`` shape from the command line."""
    n, k = map(int, text.split(","))
    return n, k


def ours(x, w, ws, config=None):
    a, a_s = quantize_per_token_group(x)
    return lambda: block_scaled_gemm(a, a_s, w, ws, config=config)


SM90_CONFIG = dict(BLOCK_M=128, BLOCK_N=128, SPLIT_K=1, GROUP_M=8, num_warps=8, num_stages=5, KERNEL="sm90")
SM90_WS_CONFIG = dict(BLOCK_M=128, BLOCK_N=128, SPLIT_K=1, GROUP_M=8, num_warps=4, num_stages=6, KERNEL="sm90_ws")


def ours_sm90(x, w, ws):
    """The Gluon kernel (``gemm_sm90``) at one fixed config, before any tuned table picks it;
    from M = 128 (below, its 128-row tiles are mostly padding)."""
    return ours(x, w, ws, SM90_CONFIG) if x.shape[0] >= 128 else None


def ours_sm90_ws(x, w, ws):
    """The warp-specialized Gluon kernel (``gemm_sm90_ws``) at one fixed config, before any tuned
    table picks it; from M = 128."""
    return ours(x, w, ws, SM90_WS_CONFIG) if x.shape[0] >= 128 else None


def ours_split_sum_kernel(x, w, ws):
    """``latentspeed``'s config with its K splits summed by a second kernel (``"SUM_IN_LAUNCH": False``): the A/B of
    summing them in the GEMM's launch, where that config sums there."""
    m, (n, k) = x.shape[0], w.shape
    config = gemm_config(m, n, k, x.device)
    return ours(x, w, ws, dict(config, SUM_IN_LAUNCH=False)) if sums_in_launch(m, n, config) else None


def vllm_triton(x, w, ws):
    from vllm.model_executor.layers.quantization.utils.fp8_utils import (
        per_token_group_quant_fp8,
        w8a8_triton_block_scaled_mm,
    )

    a, a_s = per_token_group_quant_fp8(x, 128, column_major_scales=False, use_ue8m0=False)
    return lambda: w8a8_triton_block_scaled_mm(a, w, a_s, ws, [128, 128], torch.bfloat16)


def vllm_cutlass(x, w, ws):
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.quantization.utils.fp8_utils import per_token_group_quant_fp8
    from vllm.model_executor.layers.quantization.utils.w8a8_utils import CUTLASS_BLOCK_FP8_SUPPORTED

    if not CUTLASS_BLOCK_FP8_SUPPORTED or w.shape[0] % 128 or w.shape[1] % 128:
        return None  # its SM90 blockwise kernel needs N and K multiples of 128
    a, a_s = per_token_group_quant_fp8(x, 128, column_major_scales=True, use_ue8m0=False)
    return lambda: ops.cutlass_scaled_mm(a, w.t(), scale_a=a_s, scale_b=ws.t(), out_dtype=torch.bfloat16)


def vllm_deep_gemm(x, w, ws):
    from vllm.model_executor.layers.quantization.utils.fp8_utils import per_token_group_quant_fp8
    from vllm.utils.deep_gemm import fp8_gemm_nt, is_deep_gemm_supported, should_use_deepgemm_for_fp8_linear

    if not is_deep_gemm_supported() or not should_use_deepgemm_for_fp8_linear(torch.bfloat16, tuple(w.shape)):
        return None
    a, a_s = per_token_group_quant_fp8(x, 128, column_major_scales=True, tma_aligned_scales=True, use_ue8m0=False)
    out = torch.empty(x.shape[0], w.shape[0], dtype=torch.bfloat16, device="cuda")

    def run():
        fp8_gemm_nt((a, a_s), (w, ws), out, is_deep_gemm_e8m0_used=False)
        return out

    return run


def sglang_triton(x, w, ws):
    from sglang.kernels.ops.quantization.fp8_kernel import sglang_per_token_group_quant_fp8, w8a8_block_fp8_matmul_triton

    a, a_s = sglang_per_token_group_quant_fp8(x, 128)
    return lambda: w8a8_block_fp8_matmul_triton(a, w, a_s, ws, [128, 128], torch.bfloat16)


def sglang_cutlass(x, w, ws):
    from sglang.kernels.ops.gemm.fp8_blockwise_gemm import fp8_blockwise_scaled_mm
    from sglang.kernels.ops.quantization.fp8_kernel import sglang_per_token_group_quant_fp8_row_padded

    if w.shape[0] % 128 or w.shape[1] % 128:
        return None  # SGLang's own rule: other shapes fall back to its Triton kernel
    a, a_s = sglang_per_token_group_quant_fp8_row_padded(x, 128)  # the layout its linear layer hands over
    return lambda: fp8_blockwise_scaled_mm(a, w.T, a_s, ws.T, out_dtype=torch.bfloat16)[: x.shape[0]]


def cublas_bf16(x, w, ws):
    w_bf16 = dequantize_weight_blocks_ref(w, ws).bfloat16()
    return lambda: x @ w_bf16.T


PROVIDERS = {"latentspeed": ours, "latentspeed-split-sum-kernel": ours_split_sum_kernel,
             "latentspeed-sm90": ours_sm90, "latentspeed-sm90-ws": ours_sm90_ws,
             "vLLM-Triton": vllm_triton, "vLLM-CUTLASS": vllm_cutlass, "vLLM-DeepGEMM": vllm_deep_gemm,
             "SGLang-Triton": sglang_triton, "SGLang-CUTLASS": sglang_cutlass, "cuBLAS-bf16": cublas_bf16}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", nargs="+", type=shape_arg, default=SHAPES, metavar="N,K")
    parser.add_argument("--m", type=int, nargs="+", default=[1, 16, 64, 128, 512, 4096])
    parser.add_argument("--providers", nargs="+", choices=list(PROVIDERS), default=list(PROVIDERS),
                        help="each engine's kernels need that engine on the path (vLLM and SGLang: one run each)")
    parser.add_argument("--cuda-graph", action="store_true", help="time CUDA-graph replays of each call")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rows = []
    for n, k in args.shapes:
        w, ws = quantize_weight_blocks_ref(torch.randn(n, k, device="cuda") / k**0.5)
        w_deq = dequantize_weight_blocks_ref(w, ws)
        for m in args.m:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = x.float() @ w_deq.T
            quant_us = triton.testing.do_bench(lambda: quantize_per_token_group(x), return_mode="median") * 1e3
            for name in args.providers:
                make = PROVIDERS[name]
                try:
                    fn = make(x, w, ws)
                    if fn is None:
                        continue
                    fn = in_cuda_graph(fn) if args.cuda_graph else fn
                    err = ((fn().float() - ref).norm() / ref.norm()).item()
                    us = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3
                except Exception as exc:  # a kernel refusing a shape, or missing on this card
                    print(f"{name} m{m} n{n} k{k}: unavailable ({type(exc).__name__}: {str(exc)[:160]})", file=sys.stderr)
                    continue
                row = dict(provider=name, m=m, n=n, k=k, cuda_graph=args.cuda_graph, us=us,
                           tflop_s=2 * m * n * k / us / 1e6, rel_err=err)
                if name in ("latentspeed", "latentspeed-split-sum-kernel"):
                    row.update(quant_us=quant_us, config=gemm_config(m, n, k, x.device))
                if name in ("latentspeed-sm90", "latentspeed-sm90-ws"):
                    row.update(config=SM90_CONFIG if name == "latentspeed-sm90" else SM90_WS_CONFIG)
                rows.append(row)
                print(json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        json.dump({"card": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__,
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
