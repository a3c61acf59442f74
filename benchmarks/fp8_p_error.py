"""What rounding ``P`` to E4M3 for an fp8 ``P V`` would add to the fp8 decode's error, on the CPU:
the relative error against fp32 attention of (a) E4M3 queries (what the sm_90 kernels do over fp8
caches), (b) E4M3 queries and ``P`` scaled by 256 then rounded to E4M3, (c) ``P`` alone, on
``benchmarks.mla_decode``'s input distribution (cache N(0, 0.25) in E4M3, bf16 queries N(0, 1)),
with the softmax sharpened by multiplying the logits by ``--sharpen``.

    python3 -m benchmarks.fp8_p_error --heads 16 --ctx 4096 --sharpen 1 4
"""

import argparse
import json

import torch

from benchmarks.mla_decode import D_LATENT, D_ROPE, SCALE
from common_kernels.mla.reference import quantize_query_rows

P_SCALE = 256.0


def attention(q: torch.Tensor, keys: torch.Tensor, round_p: bool) -> torch.Tensor:
    """Absorbed MLA decode for one token a request: ``q [B, H, D_LATENT + D_ROPE]``, ``keys [B, N, same]``."""
    s = torch.einsum("bhd,bnd->bhn", q, keys) * SCALE
    p = torch.exp(s - s.amax(-1, keepdim=True))
    pv = (p * P_SCALE).to(torch.float8_e4m3fn).float() / P_SCALE if round_p else p
    return torch.einsum("bhn,bnd->bhd", pv, keys[..., :D_LATENT]) / p.sum(-1, keepdim=True)


def errors(batch: int, heads: int, ctx: int, sharpen: float, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    keys = (torch.randn(batch, ctx, D_LATENT + D_ROPE, generator=gen) * 0.5).to(torch.float8_e4m3fn).float()
    q = torch.randn(batch, heads, D_LATENT + D_ROPE, generator=gen).to(torch.bfloat16).float() * sharpen
    q8 = torch.cat(quantize_query_rows(q[..., :D_LATENT], q[..., D_LATENT:]), -1)
    ref = attention(q, keys, round_p=False)

    def rel(out):
        return ((out - ref).norm() / ref.norm()).item()

    return {"heads": heads, "ctx": ctx, "sharpen": sharpen, "e4m3_queries": rel(attention(q8, keys, False)),
            "e4m3_queries_and_p": rel(attention(q8, keys, True)), "e4m3_p_only": rel(attention(q, keys, True))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--ctx", type=int, default=4096)
    parser.add_argument("--sharpen", type=float, nargs="+", default=[1.0, 4.0])
    args = parser.parse_args()
    for sharpen in args.sharpen:
        print(json.dumps(errors(args.batch, args.heads, args.ctx, sharpen)), flush=True)


if __name__ == "__main__":
    main()
