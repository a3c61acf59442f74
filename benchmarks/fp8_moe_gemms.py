"""The fused MoE's two expert GEMMs alone, on one set of sorted rows: latentspeed's kernels (the
warp-specialized Hopper ones and the Triton launch) against DeepGEMM's grouped contiguous GEMM
(``m_grouped_fp8_gemm_nt_contiguous``, from vLLM's bundle), as CUDA-graph replays.

DeepSeek-V3's experts (256, top 8, H = 7168, I = 2048) at T tokens routed at random, the pairs
sorted by ``align_by_expert`` into runs of DeepGEMM's contiguous alignment (128 rows on Hopper; our
down kernel needs the same). Both read the same fp8 operands: x quantized into the sorted rows
(``quantize_to_sorted_rows``) and the intermediate ``h`` our gate/up GEMM wrote; DeepGEMM gets the
scales in the column-major layout it reads (converted outside the timed region; fp32 scales,
``VLLM_USE_DEEP_GEMM_E8M0=0``).

- gate/up: ours stores ``silu(gate) * up`` quantized (E4M3, I columns); DeepGEMM the bf16 ``[P, 2I]``
  product, whose activation and quantization are other kernels in vLLM (not timed here). Ours under
  ``SEPARATE_ACT`` twice: ``-products``, the bf16 products alone (DeepGEMM's work), and ``-separate``,
  with ``silu_mul_group_quant`` after it (what the MoE runs).
- down: both store bf16 ``[P, H]``; ours also multiplies each row by its routing weight.

Our Triton launch runs at these 128-row runs too (8 warps), not at the tuned table's 64-row runs.

TFLOP/s count the real pairs' rows only (``2 T k N K``), so padding is a cost. Each provider's
output is compared on the real rows with DeepGEMM's (``rel_err_vs_deepgemm``).

    python -m benchmarks.fp8_moe_gemms --out benchmarks/results/fp8_moe_gemms.json
"""

import os

os.environ.setdefault("VLLM_USE_DEEP_GEMM_E8M0", "0")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402

from benchmarks.fp8_moe import SHAPES, expert_weights  # noqa: E402
from benchmarks.timing import in_cuda_graph  # noqa: E402
from common_kernels.fp8 import moe, silu_mul_group_quant  # noqa: E402

WS_GATE_UP = {"KERNEL": "sm90_ws", "BLOCK_N": 128, "num_warps": 4, "num_stages": 4}
WS_DOWN = {"KERNEL": "sm90_ws", "BLOCK_N": 128, "num_warps": 4, "num_stages": 6}
WS_SEPARATE = dict(WS_DOWN, SEPARATE_ACT=True)
TRITON = {"BLOCK_N": 128, "num_warps": 8, "num_stages": 3}  # 128-row tiles: 8 warps hold gate and up


def row_experts(runs: moe.ExpertRuns, num_pairs: int) -> torch.Tensor:
    """DeepGEMM's ``m_indices`` for the sorted rows: each row's expert, -1 for padding and unused rows."""
    block_m = runs.sorted_ids.shape[0] // runs.block_expert.shape[0]
    experts = runs.block_expert.repeat_interleave(block_m)
    return torch.where(runs.sorted_ids < num_pairs, experts, -1).to(torch.int32)


def gate_up_providers(x, w13, s13, runs, top_k, weights, a, a_scale, h, h_scale):
    """``name -> (run, output on the sorted rows as fp32 silu(gate) * up)``."""
    pairs, inter = runs.position.shape[0], w13.shape[1] // 2

    def ws():
        moe._moe_gate_up_sm90_ws(a, a_scale, w13, s13, h, h_scale, runs, pairs, WS_GATE_UP, x.dtype, None)
        return h

    a_tok, a_tok_scale = moe.quantize_per_token_group(x, 128)

    def triton_launch():
        moe._moe_gemm(a_tok, a_tok_scale, w13, s13, h, runs, pairs, weights, top_k, True, False, TRITON,
                      out_scale=h_scale, mid_dtype=x.dtype)
        return h

    products = x.new_empty(a.shape[0], 2 * inter)

    def ws_products():
        moe._moe_gemm(a, a_scale, w13, s13, products, runs, pairs, None, None, False, False, WS_SEPARATE)
        return products

    separate = {}

    def ws_separate():
        separate["h"] = silu_mul_group_quant(ws_products(), 128, rows_limit=runs.used_rows,
                                             pair_ids=(runs.sorted_ids, pairs))
        return separate["h"]

    def dequantized(q=None):
        q, q_scale = q or (h, h_scale)
        return (q.float().view(q.shape[0], -1, 128) * q_scale[:, :, None]).view(q.shape[0], inter)

    providers = {"latentspeed-sm90-ws": (ws, dequantized), "latentspeed-triton": (triton_launch, dequantized),
                 "latentspeed-sm90-ws-products": (ws_products, lambda: gated(products)),
                 "latentspeed-sm90-ws-separate": (ws_separate, lambda: dequantized(separate["h"]))}
    deep = deep_gemm_grouped(a, a_scale, w13, s13, runs, pairs)
    if deep is not None:
        providers["DeepGEMM"] = (deep, lambda: gated(deep()))
    return providers


def down_providers(w2, s2, runs, weights, h, h_scale, hidden, dtype):
    pairs = runs.position.shape[0]
    out = torch.empty(h.shape[0], hidden, dtype=dtype, device=h.device)

    def launch(config):
        def run():
            moe._moe_gemm(h, h_scale, w2, s2, out, runs, pairs, weights, None, False, True, config)
            return out
        return run, lambda: out.float()

    providers = {"latentspeed-sm90-ws": launch(WS_DOWN), "latentspeed-triton": launch(TRITON)}
    deep = deep_gemm_grouped(h, h_scale, w2, s2, runs, pairs)
    if deep is not None:  # the routing weight applied outside the timed region, for the comparison
        row_weight = torch.where(runs.sorted_ids < pairs, weights[runs.sorted_ids.clamp(max=pairs - 1).long()], 0)
        providers["DeepGEMM"] = (deep, lambda: deep().float() * row_weight[:, None])
    return providers


def gated(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.float().chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def deep_gemm_grouped(a, a_scale, w, w_scale, runs, pairs):
    """DeepGEMM's grouped contiguous GEMM over the sorted rows, or None where it cannot run here."""
    try:
        from vllm.utils.deep_gemm import (
            get_col_major_tma_aligned_tensor,
            get_mk_alignment_for_contiguous_layout,
            is_deep_gemm_supported,
            m_grouped_fp8_gemm_nt_contiguous,
        )
    except ImportError as err:
        print(f"DeepGEMM unavailable ({err})", file=sys.stderr)
        return None
    block_m = runs.sorted_ids.shape[0] // runs.block_expert.shape[0]
    if not is_deep_gemm_supported() or get_mk_alignment_for_contiguous_layout()[0] != block_m:
        print(f"DeepGEMM unavailable (supported: {is_deep_gemm_supported()}, runs of {block_m} rows)", file=sys.stderr)
        return None
    scales, m_indices = get_col_major_tma_aligned_tensor(a_scale), row_experts(runs, pairs)
    out = torch.empty(a.shape[0], w.shape[1], dtype=torch.bfloat16, device=a.device)

    def run():
        m_grouped_fp8_gemm_nt_contiguous((a, scales), (w, w_scale), out, m_indices)
        return out

    return run


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    experts, top_k, hidden, inter = SHAPES["deepseek_v3"]
    w13, s13 = expert_weights(experts, 2 * inter, hidden)
    w2, s2 = expert_weights(experts, hidden, inter)
    rows = []
    for tokens in args.tokens:
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
        weights, ids = torch.softmax(torch.randn(tokens, experts, device="cuda"), -1).topk(top_k, dim=-1)
        weights = weights.flatten().float().contiguous()
        runs = moe.align_by_expert(ids.to(torch.int32), experts, 128)
        real = runs.sorted_ids < tokens * top_k
        a, a_scale = moe.quantize_to_sorted_rows(x, runs, top_k)
        a.view(torch.uint8)[~real], a_scale[~real] = 0, 1.0  # padding rows: zeros for DeepGEMM (ours ignores them)
        h = torch.empty(a.shape[0], inter, dtype=torch.float8_e4m3fn, device="cuda")
        h_scale = torch.empty(a.shape[0], inter // 128, dtype=torch.float32, device="cuda")
        for gemm, (n, k) in (("gate_up", (2 * inter, hidden)), ("down", (hidden, inter))):
            if gemm == "gate_up":
                providers = gate_up_providers(x, w13, s13, runs, top_k, weights, a, a_scale, h, h_scale)
            else:
                moe._moe_gate_up_sm90_ws(a, a_scale, w13, s13, h, h_scale, runs, tokens * top_k, WS_GATE_UP,
                                         x.dtype, None)  # the h both down GEMMs read
                providers = down_providers(w2, s2, runs, weights, h, h_scale, hidden, x.dtype)
            outs = {}
            for name, (run, result) in providers.items():
                run()
                outs[name] = result()[real].clone()
                ms = triton.testing.do_bench(in_cuda_graph(run), warmup=10, rep=100, return_mode="median")
                rows.append(dict(gemm=gemm, tokens=tokens, provider=name, us=ms * 1e3,
                                 tflop_s=2 * tokens * top_k * n * k / ms / 1e9))
                print(json.dumps(rows[-1]), flush=True)
            if "DeepGEMM" in outs:
                ref = outs["DeepGEMM"]
                for row in rows[-len(outs):]:
                    row["rel_err_vs_deepgemm"] = ((outs[row["provider"]] - ref).norm() / ref.norm()).item()
    with open(args.out, "w") as f:
        json.dump({"card": torch.cuda.get_device_name(0), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
