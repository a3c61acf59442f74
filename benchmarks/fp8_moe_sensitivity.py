"""How far the block-FP8 MoE's output moves when its gate/up sums move a little, on the CPU, with the
reference's arithmetic (``reference.fused_moe_fp8_ref``): the intermediate ``silu(gate) * up`` is
rounded to bf16 and quantized again per 128 columns, so a tiny change of a group's largest value
changes its scale and every value of the group can round to its other fp8 neighbour.

Each gate/up product of the reference is multiplied by ``1 + eps * N(0, 1)`` (what an accumulation in
another order or precision does: Hopper's fp8 wgmma accumulates with fewer bits than fp32), and the
output is compared with the unperturbed reference: per token, the relative RMS error, and whether
the token fails ``tests/gpu/test_moe_sm90_ws.py``'s former check (``|a - e| <= 2e-2 + 2e-2 |e|``
everywhere). Inputs as that test draws them (x N(0, 1) bf16, weights N(0, 0.05²) block-quantized,
one expert without tokens, one shared expert).

    python3 -m benchmarks.fp8_moe_sensitivity --eps 1e-4 1e-3 1e-2 --cases 300
"""

import argparse
import json

import torch

from common_kernels.fp8 import reference
from common_kernels.fp8.moe import append_shared_experts


def moe_case(gen: torch.Generator, experts=8, hidden=256, inter=256, top_k=2, std=0.05):
    """One token's inputs, as the GPU test draws them."""
    def weights(rows, cols):
        pairs = [reference.quantize_weight_blocks_ref(torch.randn(rows, cols, generator=gen) * std)
                 for _ in range(experts)]
        return torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])

    w13, s13 = weights(2 * inter, hidden)
    w2, s2 = weights(hidden, inter)
    logits = torch.randn(1, experts, generator=gen)
    logits[:, 1] = -1e9
    routing, ids = torch.softmax(logits, -1).topk(top_k, dim=-1)
    ids, routing = append_shared_experts(ids, routing, first_shared=experts - 1, num_shared=1)
    x = torch.randn(1, hidden, generator=gen).to(torch.bfloat16)
    return x, w13, s13, w2, s2, routing, ids


def moe_with_noisy_gate_up(inputs, eps: float, gen: torch.Generator) -> torch.Tensor:
    """The reference MoE with each gate/up product (``[1, 2I]``) perturbed by ``1 + eps N(0, 1)``."""
    exact = reference.block_scaled_gemm_ref
    inter2 = inputs[1].shape[1]

    def noisy(a, a_scale, b, b_scale, out_dtype=torch.bfloat16, block=128):
        out = exact(a, a_scale, b, b_scale, out_dtype, block)
        if out.shape[1] != inter2:
            return out
        return out * (1 + eps * torch.randn(out.shape, generator=gen))

    reference.block_scaled_gemm_ref = noisy
    try:
        return reference.fused_moe_fp8_ref(*inputs)
    finally:
        reference.block_scaled_gemm_ref = exact


def sensitivity(eps: float, cases: int, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    rel_rms, fails = [], 0
    for _ in range(cases):
        inputs = moe_case(gen)
        expected = reference.fused_moe_fp8_ref(*inputs).float()
        moved = moe_with_noisy_gate_up(inputs, eps, gen).float()
        diff = (moved - expected).abs()
        rel_rms.append((diff.pow(2).mean().sqrt() / expected.pow(2).mean().sqrt()).item())
        fails += bool((diff > 2e-2 + 2e-2 * expected.abs()).any())
    rel_rms = torch.tensor(rel_rms)
    return {"eps": eps, "cases": cases, "median_rel_rms": rel_rms.median().item(),
            "p99_rel_rms": rel_rms.quantile(0.99).item(), "max_rel_rms": rel_rms.max().item(),
            "fraction_failing_elementwise_2e-2": fails / cases}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--eps", type=float, nargs="+", default=[1e-4, 1e-3, 1e-2])
    parser.add_argument("--cases", type=int, default=300)
    args = parser.parse_args()
    for eps in args.eps:
        print(json.dumps(sensitivity(eps, args.cases)), flush=True)


if __name__ == "__main__":
    main()
