"""What rounding ``P`` to the cache's fp8 format (the narrow decode kernel's fp8 ``P V``,
``DecodePlan.fp8_probs``) adds to the fp8 decode's error, on the CPU, with the references'
arithmetic (``reference.quantize_query_rows``, ``reference.fp8_probs_weights``): the relative error
of (a) E4M3 queries (what the sm_90 kernels do over fp8 caches), (b) E4M3 queries and fp8 ``P``,
(c) ``P`` alone, against fp32 attention on the same fp8 cache, and of the fp8 cache itself and
(a), (b) against fp32 attention on the bf16 cache the fp8 one was rounded from. Inputs as
``benchmarks.mla_decode``'s (cache N(0, 0.25), bf16 queries N(0, 1)), the softmax sharpened by
multiplying the logits by ``--sharpen``; ``--cache`` picks the fp8 formats (cache and ``P`` alike).

    python3 -m benchmarks.fp8_p_error --heads 16 --ctx 4096 --sharpen 1 4 --cache e4m3 e5m2
"""

import argparse
import json

import torch

from benchmarks.mla_decode import D_LATENT, D_ROPE, SCALE
from common_kernels.mla.reference import fp8_probs_weights, quantize_query_rows


FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def attention(q: torch.Tensor, keys: torch.Tensor, probs_dtype: torch.dtype | None) -> torch.Tensor:
    """Absorbed MLA decode for one token a request: ``q [B, H, D_LATENT + D_ROPE]``, ``keys [B, N, same]``;
    the softmax numerators rounded to ``probs_dtype`` unless it is ``None``."""
    s = torch.einsum("bhd,bnd->bhn", q, keys) * SCALE
    weights = torch.softmax(s, dim=-1) if probs_dtype is None else fp8_probs_weights(s, fp8_dtype=probs_dtype)
    return torch.einsum("bhn,bnd->bhd", weights, keys[..., :D_LATENT])


def errors(batch: int, heads: int, ctx: int, sharpen: float, cache: str, seed: int = 0) -> dict:
    fp8 = FORMATS[cache]
    gen = torch.Generator().manual_seed(seed)
    keys_bf16 = (torch.randn(batch, ctx, D_LATENT + D_ROPE, generator=gen) * 0.5).to(torch.bfloat16).float()
    keys = keys_bf16.to(fp8).float()
    q = torch.randn(batch, heads, D_LATENT + D_ROPE, generator=gen).to(torch.bfloat16).float() * sharpen
    q8 = torch.cat(quantize_query_rows(q[..., :D_LATENT], q[..., D_LATENT:]), -1)
    ref, ref_bf16 = attention(q, keys, None), attention(q, keys_bf16, None)
    queries, queries_and_p = attention(q8, keys, None), attention(q8, keys, fp8)

    def rel(out, against):
        return ((out - against).norm() / against.norm()).item()

    return {"cache": cache, "heads": heads, "ctx": ctx, "sharpen": sharpen, "e4m3_queries": rel(queries, ref),
            "e4m3_queries_and_p": rel(queries_and_p, ref), "p_only": rel(attention(q, keys, fp8), ref),
            "vs_bf16_cache": {"cache": rel(ref, ref_bf16), "cache_and_queries": rel(queries, ref_bf16),
                              "cache_queries_and_p": rel(queries_and_p, ref_bf16)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--ctx", type=int, default=4096)
    parser.add_argument("--sharpen", type=float, nargs="+", default=[1.0, 4.0])
    parser.add_argument("--cache", nargs="+", default=["e4m3"], choices=list(FORMATS))
    args = parser.parse_args()
    for cache in args.cache:
        for sharpen in args.sharpen:
            print(json.dumps(errors(args.batch, args.heads, args.ctx, sharpen, cache)), flush=True)


if __name__ == "__main__":
    main()
