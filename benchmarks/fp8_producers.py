"""Producers fused with the per-token-group (1 x 128) fp8 quantization of their output, against
vLLM's own kernels in one process: RMSNorm (with the residual add, as DeepSeek-V3's
``input_layernorm``; without it, as ``q_a_layernorm``) and SiLU-and-mul (the dense MLP's and a
shared expert's ``down_proj`` input).

Providers per shape:
- ``latentspeed``: ``rms_norm_group_quant`` / ``silu_mul_group_quant`` (one launch);
- ``latentspeed-guarded``: the same with ``stats``, counting non-finite values, as the engines call them
  while the fp8 guard is on (the default);
- ``vLLM-fused``: vLLM's CUDA ``rms_norm_per_block_quant`` / ``silu_and_mul_per_block_quant``;
- ``vLLM-unfused``: vLLM's CUDA ``fused_add_rms_norm`` or ``rms_norm`` / ``silu_and_mul``, then its
  ``per_token_group_quant_fp8`` (what runs when nothing fuses them);
- ``latentspeed-unfused``: vLLM's CUDA producer, then latentspeed's ``quantize_per_token_group``
  (what latentspeed's linear layer does when its pass does not fuse).

CUDA-graph replays, CUDA-event medians (``triton.testing.do_bench``); GB/s counts the bytes each
fused kernel must move (inputs read once, fp8 values and scales written, the residual written
back). Each provider's dequantized output is compared with latentspeed's reference.

    python -m benchmarks.fp8_producers --out benchmarks/results/fp8_producers.json
"""

import argparse
import json
import sys

import torch
import triton

from benchmarks.timing import in_cuda_graph
from common_kernels.fp8 import quantize_per_token_group, rms_norm_group_quant, silu_mul_group_quant
from common_kernels.fp8.reference import rms_norm_group_quant_ref, silu_mul_group_quant_ref

FP8 = torch.float8_e4m3fn
EPS = 1e-6
# name: (producer, width): the norm's row or the activation's output width
SHAPES = {
    "input_layernorm": ("add_rms_norm", 7168),
    "q_a_layernorm": ("rms_norm", 1536),
    "dense_mlp": ("silu_mul", 18432),
    "shared_expert": ("silu_mul", 2048),
}


def dequantized(q, scales):
    return q.float() * scales.repeat_interleave(128, 1)[:, :q.shape[1]]


def latentspeed_provider(producer, x, weight, residual, stats=None):
    """``(reference (q, scales), latentspeed's fused call)``, counting into the guard's ``stats`` if given."""
    if producer == "silu_mul":
        return silu_mul_group_quant_ref(x), lambda: silu_mul_group_quant(x, stats=stats)
    r = residual if producer == "add_rms_norm" else None
    return (rms_norm_group_quant_ref(x, weight, EPS, r)[:2],
            lambda: rms_norm_group_quant(x, weight, EPS, r, stats=stats)[:2])


def vllm_providers(producer, x, weight, residual):
    """vLLM's fused and unfused paths as ``name: (timed, checked)``. Its norms work in place: each
    instance normalizes copies made once (over repeated calls their values drift, their cost does
    not); the checked instance is called once, first."""
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.quantization.utils.fp8_utils import per_token_group_quant_fp8

    def unfused(quantize):
        if producer == "silu_mul":
            out = torch.empty(x.shape[0], x.shape[1] // 2, dtype=x.dtype, device=x.device)
            return lambda: (torch.ops._C.silu_and_mul(out, x), quantize(out))[1]
        if producer == "rms_norm":
            out = torch.empty_like(x)
            return lambda: (ops.rms_norm(out, x, weight, EPS), quantize(out))[1]
        y, r = x.clone(), residual.clone()  # this provider's own copies, normalized in place
        return lambda: (ops.fused_add_rms_norm(y, r, weight, EPS), quantize(y))[1]

    def fused():
        if producer == "silu_mul":
            return lambda: ops.silu_and_mul_per_block_quant(x, 128, FP8)
        r = residual.clone() if producer == "add_rms_norm" else None  # its own copy, updated in place
        return lambda: ops.rms_norm_per_block_quant(x, weight, EPS, FP8, [1, 128], residual=r)

    def vllm_quant(y):
        return per_token_group_quant_fp8(y, 128, dtype=FP8)

    def ours_quant(y):
        return quantize_per_token_group(y, 128)

    # two instances of each: one timed, one checked on fresh copies
    return {"vLLM-fused": (fused(), fused()),
            "vLLM-unfused": (unfused(vllm_quant), unfused(vllm_quant)),
            "latentspeed-unfused": (unfused(ours_quant), unfused(ours_quant))}

def fused_bytes(producer, tokens, width):
    if producer == "silu_mul":
        return tokens * (2 * width * 2 + width + width // 128 * 4)
    reads = tokens * width * 2 * (2 if producer == "add_rms_norm" else 1) + width * 2
    writes = tokens * (width + width // 128 * 4) + (tokens * width * 2 if producer == "add_rms_norm" else 0)
    return reads + writes


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 128, 512, 4096, 16384])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rows = []
    for shape in args.shapes:
        producer, width = SHAPES[shape]
        for tokens in args.tokens:
            cols = 2 * width if producer == "silu_mul" else width
            x = torch.randn(tokens, cols, device="cuda", dtype=torch.bfloat16) * 2
            weight = (torch.rand(width, device="cuda") + 0.5).bfloat16()
            residual = torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16)
            expected, ours = latentspeed_provider(producer, x, weight, residual)
            stats = torch.zeros(2, dtype=torch.int32, device="cuda")
            guarded = latentspeed_provider(producer, x, weight, residual, stats)[1]
            providers = {"latentspeed": (ours, ours), "latentspeed-guarded": (guarded, guarded)}
            try:
                providers.update(vllm_providers(producer, x, weight, residual))
            except ImportError as err:  # vLLM missing on this host
                print(f"vLLM unavailable ({err})", file=sys.stderr)
            reference = dequantized(*expected)
            times = {}
            for name, (timed, checked) in providers.items():
                got = dequantized(*checked()[:2])  # before the timed calls move the scratch copies
                fn = in_cuda_graph(timed)
                ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
                times[name] = ms
                rows.append({"shape": shape, "producer": producer, "width": width, "tokens": tokens, "provider": name,
                             "us": ms * 1e3, "gb_s": fused_bytes(producer, tokens, width) / ms / 1e6,
                             "rel_err_vs_reference": ((got - reference).norm() / reference.norm()).item()})
                print(json.dumps(rows[-1]), flush=True)
            for row in rows[-len(providers):]:
                row["vs_latentspeed"] = times[row["provider"]] / times["latentspeed"]
    with open(args.out, "w") as f:
        json.dump({"card": torch.cuda.get_device_name(0), "command": " ".join(sys.argv), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
