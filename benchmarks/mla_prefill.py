"""MLA prefill kernel time: latentspeed's ``varlen_attention`` against the engines' own MHA prefill kernels.

MLA prefill up-projects the latent cache into ordinary heads (DeepSeek-V3: ``D_qk = 192``, ``D_v = 128``), so both
engines run a variable-length FlashAttention there:

- ``FA3``: vLLM's ``vllm_flash_attn.flash_attn_varlen_func`` with ``fa_version=3`` (vLLM's MLA prefill on Hopper,
  ``FLASH_ATTN``; SGLang's ``fa3`` backend runs FlashAttention-3 too, from its own ``sgl_kernel`` build);
- ``FLASHINFER``: FlashInfer's ``BatchPrefillWithRaggedKVCacheWrapper`` (SGLang's ``flashinfer`` MLA backend;
  ``backend="auto"``, FA3 on sm_90), planned once before the timed calls.

Cases (``--cases``): ``causal:NxL``, N sequences of L new tokens attending to themselves (a prompt, or a chunk of
one with no cached prefix); ``chunk:NxLqxLk``, N sequences of Lq new tokens against Lk tokens of cached prefix, not
causal, returning the log-sum-exp (SGLang's prefix chunks and vLLM's context chunks). Every provider gets the same
bf16 inputs in one process; times are CUDA-event medians of ``triton.testing.do_bench`` (L2 flushed) as eager calls.
FLOPs count ``2 * H * (D_qk + D_v)`` per query-key pair that the mask keeps. Each row's ``rel_err`` compares that
provider's output for the first sequence (the first ``--check-tokens`` queries) with ``varlen_attention_ref``.

    python -m benchmarks.mla_prefill --heads 128 --out benchmarks/results/mla_prefill.json
    python -m benchmarks.mla_prefill --providers latentspeed --base HEAD~1 --out ab.json   # a kernel change's A/B

Each row's ``ours_speedup_vs_<provider>`` is that provider's time over ours (above 1: ours is faster).
"""

import argparse
import functools
import json
import sys

import torch
import triton

from benchmarks.at_revision import exec_at_base, revision_source
from common_kernels.mla import prefill
from common_kernels.mla.reference import varlen_attention_ref

D_QK, D_V = 192, 128
SCALE = D_QK**-0.5
DEVICE = "cuda"


def parse_case(text: str) -> tuple[str, int, int, int]:
    """``causal:NxL`` or ``chunk:NxLqxLk`` as ``(kind, N, L_q, L_k)``."""
    kind, _, dims = text.partition(":")
    sizes = [int(x) for x in dims.split("x")]
    if kind == "causal" and len(sizes) == 2:
        return kind, sizes[0], sizes[1], sizes[1]
    if kind == "chunk" and len(sizes) == 3:
        return kind, *sizes
    raise argparse.ArgumentTypeError(f"case {text!r}: causal:NxL or chunk:NxLqxLk")


def make_inputs(num_seqs, len_q, len_k, heads, seed=0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)

    def randn(tokens, dim):
        return torch.randn(tokens, heads, dim, device=DEVICE, generator=gen, dtype=torch.bfloat16)

    q, k, v = randn(num_seqs * len_q, D_QK), randn(num_seqs * len_k, D_QK), randn(num_seqs * len_k, D_V)
    cu_q = torch.arange(0, num_seqs + 1, dtype=torch.int32, device=DEVICE) * len_q
    cu_k = torch.arange(0, num_seqs + 1, dtype=torch.int32, device=DEVICE) * len_k
    return q, k, v, cu_q, cu_k


def ours(q, k, v, cu_q, cu_k, len_q, len_k, causal, module=prefill):
    """``module.varlen_attention``; the row records the block config it ran. A revision that autotuned (before
    the config was chosen by shared memory) has its choice forgotten first, so it tunes on each case's shape."""
    out = torch.empty(q.shape[0], q.shape[1], D_V, dtype=q.dtype, device=DEVICE)

    def run():
        return module.varlen_attention(q, k, v, cu_q, cu_k, len_q, SCALE, causal, return_lse=not causal, out=out)

    kernel = module._varlen_attention_kernel
    if isinstance(kernel, triton.runtime.Autotuner):
        kernel.cache.clear()
        run.config = lambda: str(kernel.best_config)
    else:
        names = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")
        chosen = module.launch_config(q.device, q.shape[-1], v.shape[-1], q.element_size())
        run.config = lambda: ", ".join(f"{name}: {value}" for name, value in zip(names, chosen))
    return run


def fa3(q, k, v, cu_q, cu_k, len_q, len_k, causal):
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    return lambda: flash_attn_varlen_func(
        q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=len_q, max_seqlen_k=len_k,
        softmax_scale=SCALE, causal=causal, return_softmax_lse=not causal, fa_version=3,
    )


def flashinfer(q, k, v, cu_q, cu_k, len_q, len_k, causal):
    from flashinfer.prefill import BatchPrefillWithRaggedKVCacheWrapper

    wrapper = BatchPrefillWithRaggedKVCacheWrapper(torch.empty(512 << 20, dtype=torch.uint8, device=DEVICE), "NHD")
    heads = q.shape[1]
    wrapper.plan(cu_q, cu_k, heads, heads, D_QK, head_dim_vo=D_V, causal=causal, sm_scale=SCALE,
                 q_data_type=q.dtype)
    return lambda: wrapper.run(q, k, v, return_lse=not causal)


PROVIDERS = {"latentspeed": ours, "FA3": fa3, "FLASHINFER": flashinfer}


def first_output(result):
    """The attention output of a provider's call (several return ``(out, lse)``)."""
    return result[0] if isinstance(result, (tuple, list)) else result


def kept_pairs(num_seqs, len_q, len_k, causal):
    """Query-key pairs the mask keeps: with ``causal`` (bottom-right aligned, ``len_q <= len_k``) query ``i``
    sees ``len_k - len_q + i + 1`` keys."""
    if not causal:
        return num_seqs * len_q * len_k
    return num_seqs * (len_q * (len_k - len_q + 1) + len_q * (len_q - 1) // 2)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--heads", type=int, nargs="+", default=[128, 16])
    parser.add_argument("--cases", type=parse_case, nargs="+",
                        default=[parse_case(c) for c in ("causal:64x1024", "causal:8x8192", "causal:4x16384",
                                                         "chunk:4x8192x8192")])
    parser.add_argument("--providers", nargs="+", choices=list(PROVIDERS), default=list(PROVIDERS))
    parser.add_argument("--check-tokens", type=int, default=512)
    parser.add_argument("--base", help="also time common_kernels/mla/prefill.py at this git revision (or in this "
                                       "folder) as latentspeed-base: an A/B in one process")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    providers = {name: PROVIDERS[name] for name in args.providers}
    if args.base:
        base = exec_at_base(args.base, "prefill", revision_source(args.base, "prefill"))
        providers["latentspeed-base"] = functools.partial(ours, module=base)
    rows = []
    for heads in args.heads:
        for kind, num_seqs, len_q, len_k in args.cases:
            causal = kind == "causal"
            q, k, v, cu_q, cu_k = make_inputs(num_seqs, len_q, len_k, heads)
            # The reference on the first sequence, its first queries (against all the keys they see).
            n = min(args.check_tokens, len_q)
            seen = len_k - len_q + n if causal else len_k
            ref_cu_q = torch.tensor([0, n], dtype=torch.int32, device=DEVICE)
            ref_cu_k = torch.tensor([0, seen], dtype=torch.int32, device=DEVICE)
            ref, _ = varlen_attention_ref(q[:n], k[:seen], v[:seen], ref_cu_q, ref_cu_k, SCALE, causal)
            flops = 2 * heads * (D_QK + D_V) * kept_pairs(num_seqs, len_q, len_k, causal)
            baseline, shape_rows = {}, []
            for name, make in providers.items():
                try:
                    fn = make(q, k, v, cu_q, cu_k, len_q, len_k, causal)
                    got = first_output(fn())[:n].float()
                except Exception as err:  # an engine kernel missing or refusing this shape
                    print(f"{name} {kind} H{heads} {num_seqs}x{len_q}x{len_k}: unavailable "
                          f"({type(err).__name__}: {str(err)[:200]})", file=sys.stderr)
                    continue
                ms = triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")
                baseline[name] = ms
                row = dict(case=kind, heads=heads, seqs=num_seqs, len_q=len_q, len_k=len_k, provider=name,
                           us=ms * 1e3, tflop_s=flops / ms / 1e9,
                           rel_err=((got - ref).norm() / ref.norm()).item(),
                           config=fn.config() if hasattr(fn, "config") else None)
                shape_rows.append(row)
            for row in shape_rows:
                row.update({f"ours_speedup_vs_{p}": baseline[p] / baseline["latentspeed"]
                            for p in baseline if p != "latentspeed" and "latentspeed" in baseline})
                print(json.dumps(row), flush=True)
            rows += shape_rows
            del q, k, v
            torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        card = torch.cuda.get_device_name(0) if DEVICE == "cuda" else DEVICE
        json.dump({"card": card, "torch": torch.__version__, "triton": triton.__version__,
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
