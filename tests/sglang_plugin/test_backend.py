"""LatentspeedMLABackend on SGLang's real ReqToTokenPool and MLATokenToKVPool, on the CPU.

The batch objects carry the fields SGLang's ForwardBatch carries (SGLang's own CUDA-graph
replay passes such a namespace too); the layer carries RadixAttention's attributes. Kernels
run in Triton's interpreter; results are checked against the PyTorch references.
"""

from types import SimpleNamespace

import pytest
import torch

sglang = pytest.importorskip("sglang")

from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool, ReqToTokenPool  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402
from sglang.srt.runtime_context import get_parallel  # noqa: E402

from common_kernels.mla.reference import mla_decode_ref, varlen_attention_ref  # noqa: E402
from sglang_plugin.mla import LatentspeedMLABackend  # noqa: E402
from tests.common_kernels.test_mla import random_tree_masks  # noqa: E402
from tests.helpers import assert_close  # noqa: E402

HEADS, D_LATENT, D_ROPE, PAGE = 8, 512, 64, 16
CACHES = {"bf16": torch.bfloat16, "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
SCALE = 192**-0.5


def make_backend(cache_dtype=torch.bfloat16, page_size=PAGE, kv_lora_rank=D_LATENT, max_reqs=4, context=256):
    pool = MLATokenToKVPool(
        size=64 * page_size, page_size=page_size, dtype=cache_dtype, kv_lora_rank=kv_lora_rank,
        qk_rope_head_dim=D_ROPE, layer_num=1, device="cpu", enable_memory_saver=False,
    )
    runner = SimpleNamespace(
        device="cpu",
        model_config=SimpleNamespace(
            num_attention_heads=HEADS, kv_lora_rank=kv_lora_rank, qk_nope_head_dim=128, qk_rope_head_dim=D_ROPE,
            v_head_dim=128, context_len=context,
        ),
        req_to_token_pool=ReqToTokenPool(size=max_reqs, max_context_len=context, device="cpu", enable_memory_saver=False),
        token_to_kv_pool=pool,
        page_size=page_size,
        kv_cache_dtype=cache_dtype,
        dtype=torch.bfloat16,
    )
    with get_parallel().override(attn_tp_size=1):
        return LatentspeedMLABackend(runner), runner


def place_requests(runner, seq_lens):
    """Give request b (pool row b + 1) pages in scattered order; return its slots per position."""
    free_pages = torch.randperm(60) + 1  # page 0 is SGLang's dummy page
    slots = []
    for b, n in enumerate(seq_lens):
        pages = free_pages[: -(-n // PAGE)]
        free_pages = free_pages[len(pages):]
        pos = torch.arange(n)
        row = pages[pos // PAGE] * PAGE + pos % PAGE
        runner.req_to_token_pool.req_to_token[b + 1, :n] = row.to(torch.int32)
        slots.append(row)
    return slots


def raw_rows(pool, cache_dtype):
    """The layer's pool buffer as stored (uint8 for fp8, where index_put is not defined)."""
    buffer = pool.get_key_buffer(0).squeeze(1)
    return buffer.view(torch.uint8) if cache_dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else buffer


def as_stored(rows, cache_dtype):
    rows = rows.to(cache_dtype)
    return rows.view(torch.uint8) if cache_dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else rows


def mqa_layer():
    return SimpleNamespace(layer_id=0, tp_q_head_num=HEADS, tp_k_head_num=1, head_dim=D_LATENT + D_ROPE,
                           v_head_dim=D_LATENT, scaling=SCALE, k_scale_float=None)


def batch(mode, seq_lens, out_cache_loc, **fields):
    return SimpleNamespace(
        forward_mode=mode, batch_size=len(seq_lens), req_pool_indices=torch.arange(1, len(seq_lens) + 1),
        seq_lens=torch.tensor(seq_lens), seq_lens_cpu=torch.tensor(seq_lens), out_cache_loc=out_cache_loc, **fields,
    )


@pytest.mark.parametrize("cache_name", CACHES.keys())
def test_extend_over_prefix_then_decode(cache_name):
    """A chunked prefill over a cached prefix (absorbed, ragged), then one decode step: the
    pool holds what SGLang's own reader expects, and both outputs match the reference. The
    extend reads its own tokens' keys unrounded (``fresh_kv``), the prefix from the cache."""
    backend, runner = make_backend(CACHES[cache_name])
    pool, layer = runner.token_to_kv_pool, mqa_layer()
    prefix, new = [20, 0, 33], [5, 9, 1]
    seq_lens = [p + n for p, n in zip(prefix, new)]
    slots = place_requests(runner, [n + 1 for n in seq_lens])
    prefix_rows = torch.randn(sum(prefix), D_LATENT + D_ROPE)
    prefix_slots = torch.cat([s[:p] for s, p in zip(slots, prefix)])
    cache_dtype = CACHES[cache_name]
    raw_rows(pool, cache_dtype)[prefix_slots] = as_stored(prefix_rows, cache_dtype)  # cached earlier

    new_slots = torch.cat([s[p : p + n] for s, p, n in zip(slots, prefix, new)])
    kv = torch.randn(sum(new), 1, D_LATENT + D_ROPE, dtype=torch.bfloat16)
    q = torch.randn(sum(new), HEADS, D_LATENT + D_ROPE, dtype=torch.bfloat16)
    extend = batch(ForwardMode.EXTEND, seq_lens, new_slots, extend_seq_lens=torch.tensor(new, dtype=torch.int32),
                   extend_prefix_lens=torch.tensor(prefix, dtype=torch.int32), extend_seq_lens_cpu=new)
    backend.init_forward_metadata(extend)
    out = backend.forward_extend(q, kv, kv[..., :D_LATENT], layer, extend)

    stored = raw_rows(pool, cache_dtype)[new_slots]
    assert torch.equal(stored, as_stored(kv.squeeze(1).float(), cache_dtype)), "pool rows differ from a plain cast"
    cache, meta = pool.get_key_buffer(0).view(-1, PAGE, D_LATENT + D_ROPE), backend.forward_metadata
    ref, _ = mla_decode_ref(q[..., :D_LATENT], q[..., D_LATENT:], cache, meta.page_table, meta.seq_lens, SCALE,
                            query_start_loc=meta.query_start_loc, fp8_queries=meta.plan.fp8_queries(cache.dtype),
                            fresh_kv=kv.squeeze(1))
    assert_close(out.view(-1, HEADS, D_LATENT), ref, atol=2e-2, rtol=2e-2, name="extend out")

    # One decode step, queries split as DeepSeek passes them to absorbing backends.
    decode_lens = [n + 1 for n in seq_lens]
    decode_slots = torch.stack([s[n] for s, n in zip(slots, seq_lens)])
    q_nope = torch.randn(3, HEADS, D_LATENT, dtype=torch.bfloat16)
    q_rope = torch.randn(3, HEADS, D_ROPE, dtype=torch.bfloat16)
    k_nope, k_rope = torch.randn(3, 1, D_LATENT, dtype=torch.bfloat16), torch.randn(3, 1, D_ROPE, dtype=torch.bfloat16)
    step = batch(ForwardMode.DECODE, decode_lens, decode_slots)
    backend.init_forward_metadata(step)
    out = backend.forward_decode(q_nope, k_nope, k_nope, layer, step, q_rope=q_rope, k_rope=k_rope)
    meta = backend.forward_metadata
    ref, _ = mla_decode_ref(q_nope, q_rope, cache, meta.page_table, meta.seq_lens, SCALE,
                            fp8_queries=meta.plan.fp8_queries(cache.dtype))
    assert_close(out.view(-1, HEADS, D_LATENT), ref, atol=2e-2, rtol=2e-2, name="decode out")


def test_target_verify_applies_the_tree():
    backend, runner = make_backend()
    pool, layer, draft = runner.token_to_kv_pool, mqa_layer(), 6
    seq_lens = [17, 4]
    slots = place_requests(runner, [n + draft for n in seq_lens])
    raw_rows(pool, torch.bfloat16)[torch.cat(slots)] = torch.randn(sum(seq_lens) + 2 * draft, D_LATENT + D_ROPE).bfloat16()
    tree = random_tree_masks(2, draft, torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, (1,)))))
    # SGLang's FULL_MASK: per request, D rows of (seq_len + D) booleans, prefix columns all True.
    full = torch.cat([
        torch.cat([torch.ones(draft, n, dtype=torch.bool),
                   ((tree[b][:, None] >> torch.arange(draft)) & 1).bool()], dim=1).flatten()
        for b, n in enumerate(seq_lens)
    ])
    draft_slots = torch.cat([s[n:] for s, n in zip(slots, seq_lens)])
    verify = batch(ForwardMode.TARGET_VERIFY, seq_lens, draft_slots,
                   spec_info=SimpleNamespace(draft_token_num=draft, custom_mask=full))
    q = torch.randn(2 * draft, HEADS, D_LATENT + D_ROPE, dtype=torch.bfloat16)
    backend.init_forward_metadata(verify)
    assert torch.equal(backend.forward_metadata.tree_mask, tree)

    out = backend.forward_extend(q, None, None, layer, verify)

    cache, meta = pool.get_key_buffer(0).view(-1, PAGE, D_LATENT + D_ROPE), backend.forward_metadata
    ref, _ = mla_decode_ref(q[..., :D_LATENT], q[..., D_LATENT:], cache, meta.page_table, meta.seq_lens, SCALE,
                            tree_mask=tree, fp8_queries=meta.plan.fp8_queries(cache.dtype))
    assert_close(out.view(-1, HEADS, D_LATENT), ref, atol=2e-2, rtol=2e-2, name="verify out")


def test_prefill_without_prefix_runs_varlen_attention():
    backend, runner = make_backend()
    lens = [7, 30]
    layer = SimpleNamespace(layer_id=0, tp_q_head_num=HEADS, tp_k_head_num=HEADS, head_dim=192, v_head_dim=128,
                            scaling=SCALE, k_scale_float=None)
    prefill = batch(ForwardMode.EXTEND, lens, torch.zeros(sum(lens), dtype=torch.long),
                    extend_seq_lens=torch.tensor(lens, dtype=torch.int32),
                    extend_prefix_lens=torch.zeros(2, dtype=torch.int32), extend_seq_lens_cpu=lens)
    q = torch.randn(sum(lens), HEADS, 192, dtype=torch.bfloat16)
    kv = torch.randn(sum(lens), HEADS, 192 + 128, dtype=torch.bfloat16)
    backend.init_forward_metadata(prefill)

    out = backend.forward_extend(q, kv[..., :192], kv[..., 192:], layer, prefill, save_kv_cache=False)

    cu = backend.forward_metadata.query_start_loc
    ref, _ = varlen_attention_ref(q, kv[..., :192], kv[..., 192:], cu, cu, SCALE, causal=True)
    assert_close(out.view(-1, HEADS, 128), ref, atol=2e-2, rtol=2e-2, name="prefill out")


def mha_layer():
    return SimpleNamespace(layer_id=0, tp_q_head_num=HEADS, tp_k_head_num=HEADS, head_dim=192, v_head_dim=128,
                           scaling=SCALE, k_scale_float=None)


def mha_extend(prefix_lens, extend_lens, **fields):
    """An extend batch as SGLang's DeepSeek MHA paths hand it to the backend."""
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    return batch(ForwardMode.EXTEND, seq_lens, torch.zeros(sum(extend_lens), dtype=torch.long),
                 extend_seq_lens=torch.tensor(extend_lens, dtype=torch.int32), extend_seq_lens_cpu=extend_lens,
                 extend_prefix_lens=torch.tensor(prefix_lens, dtype=torch.int32), extend_prefix_lens_cpu=prefix_lens,
                 **fields)


def cumulative(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def test_mha_one_shot_attends_to_each_whole_sequence():
    backend, _ = make_backend()
    prefix, extend = [5, 20], [7, 12]
    forward = mha_extend(prefix, extend, mha_one_shot=True, mha_return_lse=False, attn_attend_prefix_cache=False)
    seq_lens = [p + e for p, e in zip(prefix, extend)]
    q = torch.randn(sum(extend), HEADS, 192, dtype=torch.bfloat16)
    kv = torch.randn(sum(seq_lens), HEADS, 192 + 128, dtype=torch.bfloat16)  # each request: prefix, then new tokens
    backend.init_forward_metadata(forward)

    out = backend.forward_extend(q, kv[..., :192], kv[..., 192:], mha_layer(), forward, save_kv_cache=False)

    ref, _ = varlen_attention_ref(q, kv[..., :192], kv[..., 192:], cumulative(extend), cumulative(seq_lens), SCALE,
                                  causal=True)
    assert_close(out.view(-1, HEADS, 128), ref, atol=2e-2, rtol=2e-2, name="one-shot out")


def test_mha_over_prefix_chunks_merges_to_attention_over_the_whole_sequence():
    """SGLang's MHA_CHUNKED_KV: new tokens causally, then each prefix chunk without a mask, merged
    by log-sum-exp (as sgl_kernel's merge_state_v2 does on the GPU)."""
    backend, _ = make_backend()
    prefix, extend = [0, 40], [9, 6]  # a request without a prefix sees no key in the chunks
    chunks = [[0, 24], [0, 16]]  # prefix tokens per request in chunk 0 and 1
    forward = mha_extend(prefix, extend, mha_one_shot=False, mha_return_lse=True, attn_attend_prefix_cache=False,
                         prefix_chunk_idx=-1, prefix_chunk_cu_seq_lens=torch.stack([cumulative(c) for c in chunks]))
    q = torch.randn(sum(extend), HEADS, 192, dtype=torch.bfloat16)
    new_kv = torch.randn(sum(extend), HEADS, 192 + 128, dtype=torch.bfloat16)
    prefix_kv = torch.randn(sum(prefix), HEADS, 192 + 128, dtype=torch.bfloat16)
    backend.init_forward_metadata(forward)
    layer = mha_layer()

    out, lse = backend.forward_extend(q, new_kv[..., :192], new_kv[..., 192:], layer, forward, save_kv_cache=False)
    assert out.shape == (sum(extend), HEADS, 128) and lse.shape == (sum(extend), HEADS) and lse.is_contiguous()
    forward.attn_attend_prefix_cache = True
    start = 0
    for i in range(len(chunks)):
        forward.prefix_chunk_idx = i
        chunk_kv = prefix_kv[start : start + sum(chunks[i])]
        start += sum(chunks[i])
        o_i, lse_i = backend.forward_extend(q, chunk_kv[..., :192], chunk_kv[..., 192:], layer, forward,
                                            save_kv_cache=False, key_value_num_tokens=chunk_kv.shape[0])
        both = torch.stack([lse, lse_i])
        merged = torch.logsumexp(both, 0)
        weights = torch.exp(both - merged)[..., None]
        out = (weights[0] * out.float() + weights[1] * o_i.float()).to(out.dtype)
        lse = merged

    # The reference: each request's keys in sequence order, its prefix (chunk 0's rows, then chunk 1's),
    # then its new tokens.
    chunk_rows = torch.arange(sum(prefix)).split([sum(c) for c in chunks])
    rows = []
    for b in range(len(extend)):
        rows += [prefix_kv[r[cumulative(c)[b] : cumulative(c)[b + 1]]] for r, c in zip(chunk_rows, chunks)]
        rows.append(new_kv[cumulative(extend)[b] : cumulative(extend)[b + 1]])
    all_kv = torch.cat(rows)
    seq_lens = [p + e for p, e in zip(prefix, extend)]
    ref, ref_lse = varlen_attention_ref(q, all_kv[..., :192], all_kv[..., 192:], cumulative(extend),
                                        cumulative(seq_lens), SCALE, causal=True)
    assert_close(out, ref, atol=2e-2, rtol=2e-2, name="merged out")
    assert_close(lse, ref_lse.t(), atol=1e-2, rtol=1e-3, name="merged lse")


@pytest.mark.parametrize(
    "kwargs, message",
    [({"page_size": 24}, r"block size 24 is not supported.*--page-size 64"), ({"kv_lora_rank": 384}, "kv_lora_rank=384")],
    ids=["page_size", "kv_lora_rank"],
)
def test_unsupported_models_are_refused_at_start(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_backend(**kwargs)


@pytest.mark.parametrize("prefill", [None, "fa3"], ids=["prefill_latentspeed", "prefill_fa3"])
def test_the_factory_builds_the_backend_whichever_backend_runs_the_extends(prefill):
    """SGLang's factory reads the prefill backend off the server arguments (to compile the MHA prefill only where
    it runs; on the CPU nothing compiles)."""
    from sglang.srt.server_args import ServerArgs

    from sglang_plugin import BACKEND_NAME, create_backend

    _, runner = make_backend()
    runner.server_args = SimpleNamespace(attention_backend=BACKEND_NAME, prefill_attention_backend=prefill,
                                         decode_attention_backend=None)
    runner.server_args.get_attention_backends = ServerArgs.get_attention_backends.__get__(runner.server_args)
    with get_parallel().override(attn_tp_size=1):
        assert isinstance(create_backend(runner), LatentspeedMLABackend)
