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
    pool holds what SGLang's own reader expects, and both outputs match the reference."""
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
                            query_start_loc=meta.query_start_loc, fp8_queries=meta.plan.fp8_queries(cache.dtype))
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


@pytest.mark.parametrize(
    "kwargs, message",
    [({"page_size": 24}, r"block size 24 is not supported.*--page-size 64"), ({"kv_lora_rank": 384}, "kv_lora_rank=384")],
    ids=["page_size", "kv_lora_rank"],
)
def test_unsupported_models_are_refused_at_start(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_backend(**kwargs)
