"""The MLA kernels against the PyTorch references at DeepSeek-V3 sizes, on a GPU.

    pytest tests/gpu -q          (skipped without a GPU)
"""

import pytest
import torch

from common_kernels.mla import mla_decode, plan_decode, sm90_kernels_apply, varlen_attention, write_latent_cache
from common_kernels.mla.reference import mla_decode_ref, varlen_attention_ref, write_latent_cache_ref
from tests.common_kernels.test_mla import CACHE_DTYPES, FP8_CACHE, make_paged_cache
from tests.helpers import assert_close, fp8_flip_bound

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def _plan(batch, num_heads, q_len, max_seq_len, cache_dtype=torch.bfloat16):
    """The plan an engine makes on this GPU (sm_90: for its Gluon kernels)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    sm90 = sm90_kernels_apply(torch.device("cuda"), cache_dtype, 64, 512, 64)
    return plan_decode(batch, num_heads, q_len, max_seq_len, sms, cache_dtype=cache_dtype, sm90=sm90)


@pytest.mark.parametrize("cache_name", CACHE_DTYPES.keys())
@pytest.mark.parametrize("num_heads", [16, 128], ids=lambda h: f"H{h}")
@pytest.mark.parametrize("q_len", [1, 2], ids=lambda q: f"q{q}")
@pytest.mark.parametrize("block_size", [64], ids=lambda b: f"page{b}")
def test_decode_full_size(cache_name, num_heads, q_len, block_size):
    seq_lens_list = (4097, 1, 2900, 0 if q_len == 1 else 2, 777, 6000)
    cache_dtype = CACHE_DTYPES[cache_name]
    kv_scale = torch.tensor([0.02], device="cuda") if cache_name in FP8_CACHE else None
    cache, table = make_paged_cache(seq_lens_list, block_size, 576, cache_dtype, 0.02 if kv_scale is not None else 1.0)
    tokens = len(seq_lens_list) * q_len
    q_nope = torch.randn(tokens, num_heads, 512, device="cuda", dtype=torch.bfloat16) * 0.1
    q_pe = torch.randn(tokens, num_heads, 64, device="cuda", dtype=torch.bfloat16)
    lens = torch.tensor(seq_lens_list, dtype=torch.int32, device="cuda")
    plan = _plan(len(seq_lens_list), num_heads, q_len, max(seq_lens_list), cache_dtype)
    out, lse = mla_decode(q_nope, q_pe, cache, table, lens, 192**-0.5, plan, kv_scale=kv_scale)
    fp8_probs = plan.fp8_probs(cache_dtype)
    bound = fp8_flip_bound(q_nope, fp8_probs)
    ref, ref_lse = mla_decode_ref(q_nope, q_pe, cache, table, lens, 192**-0.5, kv_scale or 1.0,
                                  fp8_queries=plan.fp8_queries(cache_dtype), fp8_probs=fp8_probs, flip_bound=bound)
    assert_close(out, ref, atol=1e-2, rtol=2e-2, name="decode out", slack=bound)
    assert_close(lse, ref_lse, atol=2e-3, rtol=2e-3, name="decode lse")


@pytest.mark.parametrize("cache_name", FP8_CACHE.keys())
@pytest.mark.parametrize("num_heads", [16, 128], ids=lambda h: f"H{h}")
def test_extend_with_fresh_rows_full_size(cache_name, num_heads):
    """Chunked-prefill extends over an fp8 cache, the new tokens' own rows at full precision."""
    q_lens, prefix = (128, 1, 77, 0), (4000, 0, 900, 33)
    seq_lens_list = [p + q for p, q in zip(prefix, q_lens)]
    cache_dtype = CACHE_DTYPES[cache_name]
    kv_scale = torch.tensor([0.02], device="cuda")
    cache, table = make_paged_cache(seq_lens_list, 64, 576, cache_dtype, 0.02)
    tokens = sum(q_lens)
    q_nope = torch.randn(tokens, num_heads, 512, device="cuda", dtype=torch.bfloat16) * 0.1
    q_pe = torch.randn(tokens, num_heads, 64, device="cuda", dtype=torch.bfloat16)
    fresh = torch.randn(tokens, 576, device="cuda", dtype=torch.bfloat16)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    lens = torch.tensor(seq_lens_list, dtype=torch.int32, device="cuda")
    plan = _plan(len(q_lens), num_heads, max(q_lens), max(seq_lens_list), cache_dtype)
    out, lse = mla_decode(q_nope, q_pe, cache, table, lens, 192**-0.5, plan, kv_scale=kv_scale,
                          query_start_loc=starts, fresh_kv=fresh)
    fp8_probs = plan.fp8_probs(cache_dtype)
    bound = fp8_flip_bound(q_nope, fp8_probs)
    ref, ref_lse = mla_decode_ref(q_nope, q_pe, cache, table, lens, 192**-0.5, kv_scale, query_start_loc=starts,
                                  fp8_queries=plan.fp8_queries(cache_dtype), fresh_kv=fresh, fp8_probs=fp8_probs,
                                  flip_bound=bound)
    assert_close(out, ref, atol=1e-2, rtol=2e-2, name="extend out", slack=bound)
    assert_close(lse, ref_lse, atol=2e-3, rtol=2e-3, name="extend lse")


@pytest.mark.parametrize("cache_name", CACHE_DTYPES.keys())
def test_cache_write_full_size(cache_name):
    cache_dtype = CACHE_DTYPES[cache_name]
    kv_c = torch.randn(3000, 512, device="cuda", dtype=torch.bfloat16) * 3
    k_pe = torch.randn(3000, 1, 64, device="cuda", dtype=torch.bfloat16) * 3
    slots = torch.randperm(64 * 64, device="cuda")[:3000]
    slots[::11] = -1
    scale = torch.tensor([0.01], device="cuda")
    cache = torch.full((64, 64, 576), float("nan"), device="cuda").to(cache_dtype)
    expected = cache.clone()
    write_latent_cache(kv_c, k_pe, cache, slots, kv_scale=scale)
    write_latent_cache_ref(kv_c, k_pe.squeeze(1), expected, slots, scale)
    assert_close(cache.float(), expected.float(), atol=0.0, rtol=0.0, name="cache")


@pytest.mark.parametrize("causal", [True, False], ids=["new_tokens", "context"])
def test_prefill_full_size(causal):
    q_lens = [1500, 37, 800]
    k_lens = q_lens if causal else [4000, 0, 123]
    cu_q = torch.tensor([0, 1500, 1537, 2337], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q = torch.randn(sum(q_lens), 128, 192, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(sum(k_lens), 128, 192 + 128, device="cuda", dtype=torch.bfloat16)
    out, lse = varlen_attention(q, kv[..., :192], kv[..., 192:], cu_q, cu_k, 1500, 192**-0.5, causal, return_lse=True)
    ref, ref_lse = varlen_attention_ref(q, kv[..., :192], kv[..., 192:], cu_q, cu_k, 192**-0.5, causal)
    assert_close(out, ref, atol=1e-2, rtol=2e-2, name="prefill out")
    assert_close(lse, ref_lse, atol=2e-3, rtol=2e-3, name="prefill lse")


def test_prefill_warm_up_covers_the_engines_launches():
    """After ``warm_up_varlen_attention`` the launches both engines make compile nothing more: other head and token
    counts, one-token sequences, empty chunks, V a view of a wider buffer, an output buffer handed in."""
    from common_kernels.mla import prefill

    kernel = prefill._varlen_attention_kernel
    kernel.device_caches.clear()
    prefill.warm_up_varlen_attention.cache_clear()
    prefill.warm_up_varlen_attention(torch.device("cuda"), torch.bfloat16, 192, 128)
    compiled = kernel.device_caches[torch.cuda.current_device()][0]
    assert len(compiled) == len(prefill.LAUNCH_VARIANTS)
    for heads, q_lens, k_lens, causal, lse in ((128, [1500, 1, 37], None, True, False), (16, [1], None, True, True),
                                               (128, [300, 5, 800], [4000, 0, 123], False, True)):
        k_lens = k_lens or q_lens
        cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        cu_k = torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        q = torch.randn(sum(q_lens), heads, 192, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(sum(k_lens), heads, 192, device="cuda", dtype=torch.bfloat16)
        kv_nope = torch.randn(sum(k_lens), heads, 256, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(sum(q_lens), heads * 128, device="cuda", dtype=torch.bfloat16).view(-1, heads, 128)
        varlen_attention(q, k, kv_nope[..., 128:], cu_q, cu_k, max(q_lens), 192**-0.5, causal, return_lse=lse, out=out)
    assert len(compiled) == len(prefill.LAUNCH_VARIANTS)


@pytest.mark.parametrize("cache_name", CACHE_DTYPES.keys())
def test_tree_and_ragged_decode_full_size(cache_name):
    """Tree verification (16 draft tokens) and ragged chunks over a prefix, at 128 heads."""
    from tests.common_kernels.test_mla import random_tree_masks

    cache_dtype = CACHE_DTYPES[cache_name]
    kv_scale = torch.tensor([0.02], device="cuda") if cache_name in FP8_CACHE else None
    seq_lens_list = (3000, 16, 700)
    cache, table = make_paged_cache(seq_lens_list, 64, 576, cache_dtype, 0.02 if kv_scale is not None else 1.0)
    lens = torch.tensor(seq_lens_list, dtype=torch.int32, device="cuda")
    q_nope = torch.randn(48, 128, 512, device="cuda", dtype=torch.bfloat16) * 0.1
    q_pe = torch.randn(48, 128, 64, device="cuda", dtype=torch.bfloat16)

    tree = random_tree_masks(3, 16, torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, (1,)))))
    plan = _plan(3, 128, 16, 3000, cache_dtype)
    out, _ = mla_decode(q_nope, q_pe, cache, table, lens, 192**-0.5, plan, kv_scale=kv_scale, tree_mask=tree.cuda())
    bound = fp8_flip_bound(q_nope, plan.fp8_probs(cache_dtype))  # the 16-token request's rows see a few keys
    ref, _ = mla_decode_ref(q_nope, q_pe, cache, table, lens, 192**-0.5, kv_scale or 1.0, tree_mask=tree,
                            fp8_queries=plan.fp8_queries(cache_dtype), fp8_probs=plan.fp8_probs(cache_dtype),
                            flip_bound=bound)
    assert_close(out, ref, atol=1e-2, rtol=2e-2, name="tree decode", slack=bound)

    starts = torch.tensor([0, 40, 41, 48], dtype=torch.int32, device="cuda")
    plan = _plan(3, 128, 40, 3000, cache_dtype)
    out, _ = mla_decode(q_nope, q_pe, cache, table, lens, 192**-0.5, plan, kv_scale=kv_scale, query_start_loc=starts)
    bound = fp8_flip_bound(q_nope, plan.fp8_probs(cache_dtype))
    ref, _ = mla_decode_ref(q_nope, q_pe, cache, table, lens, 192**-0.5, kv_scale or 1.0, query_start_loc=starts,
                            fp8_queries=plan.fp8_queries(cache_dtype), fp8_probs=plan.fp8_probs(cache_dtype),
                            flip_bound=bound)
    assert_close(out, ref, atol=1e-2, rtol=2e-2, name="ragged decode", slack=bound)
