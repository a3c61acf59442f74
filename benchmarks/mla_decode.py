"""MLA decode kernel time: latentspeed against vLLM's FLASHMLA, FLASH_ATTN_MLA and TRITON_MLA, and
FlashInfer's MLA kernel (SGLang's ``flashinfer`` backend).

FlashMLA's shapes: batch 128, heads 16 and 128, 1 and 2 query tokens, context 4k-32k,
page 64, bf16 and fp8 caches. Every provider reads the same cache and block table (pages
scattered at random) in one process; times are CUDA-event medians (``triton.testing.do_bench``,
which flushes L2 between runs) after warm-up. Bytes are the cache rows read once plus queries
and outputs; FLOPs are ``2 * T * H * seq_len * (D_latent + D_rope + D_latent)``.
Each row's ``rel_err_first_requests`` checks that provider's output, read after its timed calls,
against the fp32 reference on the first four requests.

    python -m benchmarks.mla_decode --out benchmarks/results/mla_decode.json

``latentspeed-triton`` is latentspeed without its Gluon kernels for sm_90, as it runs on other
GPUs. TRITON_MLA has no multi-token decode in
vLLM; for 2 query tokens it runs the equivalent 2 * B single-token rows (shown as such).
FLASH_ATTN_MLA has no fp8 path. Under ``--cuda-graph`` its graph also recomputes FA3's scheduler
metadata (a small kernel; vLLM runs it before every step); its rows give that kernel's time alone
as ``metadata_us``.
"""

import argparse
import functools
import json
import math
import sys

import torch
import triton

from benchmarks.timing import in_cuda_graph
from common_kernels.mla import mla_decode, plan_decode, sm90_kernels_apply
from common_kernels.mla.reference import mla_decode_ref

D_LATENT, D_ROPE, PAGE = 512, 64, 64
SCALE = 192**-0.5


def make_inputs(batch, heads, q_len, ctx, cache_dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    pages_per_req = math.ceil(ctx / PAGE)
    num_blocks = batch * pages_per_req
    cache = torch.randn(num_blocks, PAGE, D_LATENT + D_ROPE, device="cuda", generator=gen) * 0.5
    if cache_dtype != torch.bfloat16:
        cache = cache.clamp(-400, 400)
    cache = cache.to(cache_dtype)
    block_table = torch.randperm(num_blocks, device="cuda", generator=gen).to(torch.int32).view(batch, pages_per_req)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(batch * q_len, heads, D_LATENT + D_ROPE, device="cuda", generator=gen, dtype=torch.bfloat16)
    return q, cache, block_table, seq_lens


def ours(q, cache, block_table, seq_lens, q_len, kv_scale, sm90=None):
    batch, heads = block_table.shape[0], q.shape[1]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if sm90 is None:
        sm90 = sm90_kernels_apply(cache.device, cache.dtype, cache.shape[1], D_LATENT, D_ROPE)
    plan = plan_decode(batch, heads, q_len, int(seq_lens.max()), sms, cache_dtype=cache.dtype, sm90=sm90)
    q_nope, q_pe = q[..., :D_LATENT], q[..., D_LATENT:]
    out = torch.empty(q.shape[0], heads, D_LATENT, dtype=q.dtype, device="cuda")
    lse = torch.empty(q.shape[0], heads, dtype=torch.float32, device="cuda")
    po_shape, pl_shape = plan.workspace_shapes(D_LATENT)
    ws = (torch.empty(po_shape, device="cuda"), torch.empty(pl_shape, device="cuda"))
    scale = kv_scale if cache.dtype != torch.bfloat16 else None
    return lambda: mla_decode(q_nope, q_pe, cache, block_table, seq_lens, SCALE, plan, scale, out, lse, ws)[0]


def ours_triton(q, cache, block_table, seq_lens, q_len, kv_scale):
    """latentspeed with its Triton split kernel only, as on a GPU other than sm_90 (no Gluon kernel)."""
    return ours(q, cache, block_table, seq_lens, q_len, kv_scale, sm90=False)


def flashmla(q, cache, block_table, seq_lens, q_len, kv_scale):
    from vllm.v1.attention.ops.flashmla import (
        flash_mla_with_kvcache,
        flash_mla_with_kvcache_fp8,
        get_mla_metadata,
        get_mla_metadata_dense_fp8,
    )

    batch, heads = block_table.shape[0], q.shape[1]
    k_cache = cache.unsqueeze(-2)
    if cache.dtype == torch.bfloat16:
        q4 = q.view(batch, q_len, heads, -1)
        sched, _ = get_mla_metadata()

        def run():
            return flash_mla_with_kvcache(
                q=q4, k_cache=k_cache, block_table=block_table, cache_seqlens=seq_lens, head_dim_v=D_LATENT,
                tile_scheduler_metadata=sched, softmax_scale=SCALE, causal=True,
            )[0]

        return run
    if cache.dtype != torch.float8_e4m3fn:
        return None
    q8 = (q.float() / kv_scale).clamp(-448, 448).to(torch.float8_e4m3fn).view(batch, q_len, heads, -1)
    tile_md, num_splits = get_mla_metadata_dense_fp8(seq_lens, q_len * heads, 1)

    def run_fp8():
        return flash_mla_with_kvcache_fp8(
            q=q8, k_cache=k_cache, block_table=block_table, cache_seqlens=seq_lens, head_dim_v=D_LATENT,
            tile_scheduler_metadata=tile_md, num_splits=num_splits, softmax_scale=SCALE, causal=True,
            descale_q=kv_scale.reshape(1), descale_k=kv_scale.reshape(1),
        )[0]

    return run_fp8


def flash_attn_mla(q, cache, block_table, seq_lens, q_len, kv_scale, metadata_per_call=False):
    """vLLM's FA3 MLA decode. ``metadata_per_call``: recompute the scheduler metadata on every call,
    as vLLM's builder does before each step. A CUDA graph needs it: with the metadata computed once,
    replays after the first fail with an illegal address (the buffer holds the persistent
    scheduler's tile counter); recomputed in the graph, they run
    (``benchmarks/results/mla_decode-16-heads-2026-12-04.md``)."""
    if cache.dtype != torch.bfloat16:
        return None
    from vllm.vllm_flash_attn import flash_attn_varlen_func, get_scheduler_metadata

    batch, heads = block_table.shape[0], q.shape[1]
    cu_q = torch.arange(0, q.shape[0] + 1, q_len, dtype=torch.int32, device="cuda")
    max_k = int(seq_lens.max())
    kv_c, k_pe = cache[..., :D_LATENT].unsqueeze(-2), cache[..., D_LATENT:].unsqueeze(-2)
    q_nope, q_pe = q[..., :D_LATENT], q[..., D_LATENT:]

    def metadata():
        return get_scheduler_metadata(
            batch_size=batch, max_seqlen_q=q_len, max_seqlen_k=max_k, num_heads_q=heads, num_heads_kv=1,
            headdim=D_ROPE, cache_seqlens=seq_lens, qkv_dtype=cache.dtype, headdim_v=D_LATENT, page_size=PAGE,
            cu_seqlens_q=cu_q, causal=True,
        )

    fixed = None if metadata_per_call else metadata()

    def run():
        sched = metadata() if metadata_per_call else fixed
        return flash_attn_varlen_func(
            q=q_pe, k=k_pe, v=kv_c, q_v=q_nope, max_seqlen_q=q_len, cu_seqlens_q=cu_q, max_seqlen_k=max_k,
            seqused_k=seq_lens, block_table=block_table, softmax_scale=SCALE, causal=True, fa_version=3,
            scheduler_metadata=sched,
        )

    run.metadata = metadata  # timed alone beside the rows that include it
    return run


def flashinfer_mla(q, cache, block_table, seq_lens, q_len, kv_scale):
    """FlashInfer's MLA decode (``BatchMLAPagedAttentionWrapper``, its FA3 kernel on sm_90): the kernel
    of SGLang's ``flashinfer`` MLA backend. Planned once on the host before the timed calls (SGLang
    plans before each step); SGLang serves it with pages of one token, the table with 64 as for every
    provider. bf16 and E4M3 caches (per-tensor scales); no E5M2. Timed as eager calls even under
    ``--cuda-graph`` (``eager_only``): its replays failed (an illegal address, or "operation not supported on
    global/shared address space") unless its graph was the first captured in the process. Built as SGLang builds
    it for graphs (``use_cuda_graph=True``, index buffers of its own) it failed the same way at the second shape,
    after replays 1.8 % faster than these eager calls at the first (results/sglang-e2e-h100-2026-12-06-s45.md)."""
    if cache.dtype not in (torch.bfloat16, torch.float8_e4m3fn):
        return None
    from flashinfer.mla import BatchMLAPagedAttentionWrapper

    batch, pages = block_table.shape
    heads = q.shape[1]
    wrapper = BatchMLAPagedAttentionWrapper(torch.empty(512 << 20, dtype=torch.uint8, device="cuda"), backend="fa3")
    wrapper.plan(
        torch.arange(0, q.shape[0] + 1, q_len, dtype=torch.int32, device="cuda"),
        torch.arange(0, (batch + 1) * pages, pages, dtype=torch.int32, device="cuda"),
        block_table.reshape(-1), seq_lens, heads, D_LATENT, D_ROPE, PAGE, True, SCALE, q.dtype, cache.dtype,
    )
    q_nope, q_pe = q[..., :D_LATENT].contiguous(), q[..., D_LATENT:].contiguous()
    ckv, kpe = cache[..., :D_LATENT], cache[..., D_LATENT:]
    scales = {} if cache.dtype == torch.bfloat16 else dict(ckv_scale=kv_scale.item(), kpe_scale=kv_scale.item())
    out = torch.empty_like(q_nope)

    def run():
        return wrapper.run(q_nope, q_pe, ckv, kpe, out=out, **scales)

    run.eager_only = True
    return run


def triton_mla(q, cache, block_table, seq_lens, q_len, kv_scale):
    from vllm.v1.attention.ops.triton_decode_attention import decode_attention_fwd

    if cache.dtype == torch.float8_e5m2:
        return None
    # vLLM's TRITON_MLA decodes one query token per row: expand B requests to B * q_len rows.
    rows = q.shape[0]
    heads = q.shape[1]
    table = block_table.repeat_interleave(q_len, 0)
    offs = torch.arange(q_len, device="cuda", dtype=torch.int32).repeat(block_table.shape[0])
    lens = seq_lens.repeat_interleave(q_len) - q_len + 1 + offs
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = min(triton.next_power_of_2(max(1, int(lens.max()) // 512)), 2 * sms)
    o = torch.empty(rows, heads, D_LATENT, dtype=q.dtype, device="cuda")
    lse = torch.empty(rows, heads, dtype=q.dtype, device="cuda")
    logits = torch.empty(rows, heads, splits, D_LATENT + 1, dtype=torch.float32, device="cuda")
    kv4 = cache.unsqueeze(2)

    def run():
        decode_attention_fwd(
            q, kv4, kv4[..., :D_LATENT], o, lse, table, lens, logits, splits, SCALE, PAGE,
            k_scale=kv_scale, v_scale=kv_scale, is_mla=True,
        )
        return o

    return run


PROVIDERS = {"latentspeed": ours, "latentspeed-triton": ours_triton, "FLASHMLA": flashmla,
             "FLASH_ATTN_MLA": flash_attn_mla, "FLASHINFER_MLA": flashinfer_mla, "TRITON_MLA": triton_mla}


def copy_bandwidth_tb_s(nbytes=2 << 30):
    """The card's device-to-device copy bandwidth, bytes read plus bytes written per second (TB/s):
    issue #6's yardstick for the memory-bound rows. Same timing as the kernels (median, L2 flushed)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    return 2 * nbytes / ms / 1e9


def check_against_reference(cache_dtype, heads, q_len, kv_scale):
    """Ours against the fp32 PyTorch reference on a small batch of the same shape family."""
    q, cache, table, lens = make_inputs(2, heads, q_len, 1000, cache_dtype, seed=1)
    lens[1] = 357
    got = ours(q, cache, table, lens, q_len, kv_scale)()
    ref, _ = mla_decode_ref(q[..., :D_LATENT], q[..., D_LATENT:], cache, table, lens, SCALE, kv_scale)
    return ((got.float() - ref).norm() / ref.norm()).item()


def rel_err_first_requests(out, q, cache, block_table, seq_lens, q_len, kv_scale, requests=4):
    """A provider's output for the first ``requests`` requests (read after its timed calls, so a
    replay that went wrong shows) against the fp32 reference."""
    n = min(requests, block_table.shape[0])
    rows = n * q_len
    ref, _ = mla_decode_ref(q[:rows, :, :D_LATENT], q[:rows, :, D_LATENT:], cache, block_table[:n], seq_lens[:n],
                            SCALE, kv_scale)
    got = out.float().reshape(q.shape[0], q.shape[1], D_LATENT)[:rows]
    return ((got - ref).norm() / ref.norm()).item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--heads", type=int, nargs="+", default=[16, 128])
    parser.add_argument("--q-len", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--ctx", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    parser.add_argument("--cache", nargs="+", default=["bf16", "e4m3", "e5m2"])
    parser.add_argument("--providers", nargs="+", choices=list(PROVIDERS), default=list(PROVIDERS),
                        help="default all; one per process keeps a provider's fault from ending the others' rows")
    parser.add_argument("--cuda-graph", action="store_true",
                        help="time CUDA-graph replays, as engines run decode (small batches: no launch overhead)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dtypes = {"bf16": torch.bfloat16, "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
    kv_scale = torch.tensor([0.5], device="cuda")
    copy_tb_s = copy_bandwidth_tb_s()
    print(f"device-to-device copy: {copy_tb_s:.2f} TB/s", flush=True)
    rows = []
    for cache_name in args.cache:
        cache_dtype = dtypes[cache_name]
        for heads in args.heads:
            for q_len in args.q_len:
                rel_err = check_against_reference(cache_dtype, heads, q_len, kv_scale) if "latentspeed" in args.providers else None
                for ctx in args.ctx:
                    q, cache, table, lens = make_inputs(args.batch, heads, q_len, ctx, cache_dtype)
                    baseline = None
                    outs = {}
                    for name in args.providers:
                        make = PROVIDERS[name]
                        if args.cuda_graph and name == "FLASH_ATTN_MLA":
                            make = functools.partial(flash_attn_mla, metadata_per_call=True)
                        try:
                            fn = make(q, cache, table, lens, q_len, kv_scale)
                            if fn is None:
                                continue
                            metadata_us = None
                            if args.cuda_graph and name == "FLASH_ATTN_MLA":
                                metadata_us = 1e3 * triton.testing.do_bench(
                                    in_cuda_graph(fn.metadata), warmup=25, rep=200, return_mode="median")
                            in_graph = args.cuda_graph and not getattr(fn, "eager_only", False)
                            fn = in_cuda_graph(fn) if in_graph else fn
                            outs[name] = fn().float().reshape(q.shape[0], heads, D_LATENT).clone()
                        except Exception as err:  # an engine kernel missing or refusing this shape
                            print(f"{name} {cache_name} H{heads} q{q_len} ctx{ctx}: unavailable "
                                  f"({type(err).__name__}: {str(err)[:200]})", file=sys.stderr)
                            continue
                        ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
                        rel_err_after = rel_err_first_requests(fn(), q, cache, table, lens, q_len, kv_scale)
                        elem = cache.element_size()
                        nbytes = args.batch * ctx * (D_LATENT + D_ROPE) * elem + q.numel() * 2 * 2
                        flops = 2 * q.shape[0] * heads * ctx * (D_LATENT + D_ROPE + D_LATENT)
                        row = dict(batch=args.batch, cache=cache_name, heads=heads, q_len=q_len, ctx=ctx, provider=name,
                                   cuda_graph=in_graph, us=ms * 1e3,
                                   metadata_us=metadata_us, rel_err_first_requests=rel_err_after,
                                   tb_s=nbytes / ms / 1e9, tflop_s=flops / ms / 1e9)
                        if name == "FLASHMLA":
                            baseline = row["us"]
                        if name == "latentspeed":
                            row["rel_err_vs_reference"] = rel_err
                        rows.append(row)
                    for row in rows:
                        if (row["cache"], row["heads"], row["q_len"], row["ctx"]) == (cache_name, heads, q_len, ctx):
                            row["vs_flashmla"] = baseline / row["us"] if baseline else None
                    if "FLASHMLA" in outs and "latentspeed" in outs:
                        diff = (outs["latentspeed"] - outs["FLASHMLA"]).abs().max().item()
                        rows[-len(outs)]["max_abs_diff_vs_flashmla"] = diff
                    for row in rows[-len(outs):]:
                        print(json.dumps(row), flush=True)
                    del q, cache, table, lens
                    torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"card": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__,
                   "copy_tb_s": copy_tb_s, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
