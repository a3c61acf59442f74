"""MLA kernels against the PyTorch references (CPU: Triton interpreter; small shapes).

Caches are poisoned with NaN outside the written slots, unused block-table entries point far
out of range, and outputs are poisoned before each call, so a kernel that reads or leaves
the wrong memory fails here. Inputs are fresh random draws on every run.
"""

import math

import pytest
import torch

from common_kernels.mla import (
    mla_decode,
    plan_decode,
    split_head_dim,
    varlen_attention,
    write_latent_cache,
)
from common_kernels.mla import reference
from common_kernels.mla.prefill import prefill_config, shared_memory_needed
from common_kernels.mla.reference import (
    fp8_probs_spread,
    fp8_probs_weights,
    mla_decode_ref,
    varlen_attention_ref,
    write_latent_cache_ref,
)
from tests.helpers import BATCH_SPECS, assert_close, device

FP8_CACHE = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
CACHE_DTYPES = {"bf16": torch.bfloat16, **FP8_CACHE}
# (atol, rtol) of the decode output against the fp32 reference on the same (quantized) cache:
# P is rounded to bf16 before P.V, a relative error of at most 2^-8 per weight.
DECODE_TOL = {"bf16": (2e-2, 2e-2), "e4m3": (2e-2, 2e-2), "e5m2": (2e-2, 2e-2)}
LSE_TOL = (2e-3, 2e-3)
BAD_PAGE = 1 << 20  # an out-of-range page id: reading it faults or shows


def make_paged_cache(seq_lens, block_size, d_total, cache_dtype, kv_scale):
    """A NaN-poisoned cache with every request's pages scattered in random order, and its
    block table (unused entries out of range)."""
    dev = device()
    pages_per_req = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(pages_per_req) + 3
    fill = torch.full((num_blocks, block_size, d_total), float("nan"), device=dev)
    order = torch.randperm(num_blocks, device=dev).tolist()
    max_pages = max(pages_per_req + [1]) + 2
    block_table = torch.full((len(seq_lens), max_pages), BAD_PAGE, dtype=torch.int32, device=dev)
    for b, (n, n_pages) in enumerate(zip(seq_lens, pages_per_req)):
        ids = [order.pop() for _ in range(n_pages)]
        block_table[b, :n_pages] = torch.tensor(ids, dtype=torch.int32)
        for pos in range(n):
            fill[ids[pos // block_size], pos % block_size] = torch.randn(d_total, device=dev)
    if cache_dtype in FP8_CACHE.values():
        fp8_max = torch.finfo(cache_dtype).max
        cache = (fill / kv_scale).clamp(-fp8_max, fp8_max).to(cache_dtype)
    else:
        cache = fill.to(cache_dtype)
    return cache, block_table


@pytest.mark.parametrize("spec", BATCH_SPECS.values(), ids=BATCH_SPECS.keys())
@pytest.mark.parametrize("cache_name", CACHE_DTYPES.keys())
@pytest.mark.parametrize("num_heads", [16, 128, 5], ids=lambda h: f"H{h}")
@pytest.mark.parametrize("block_size", [16, 32, 64], ids=lambda b: f"page{b}")
@pytest.mark.parametrize("num_splits", [1, 3], ids=lambda s: f"splits{s}")
def test_decode_matches_reference(spec, cache_name, num_heads, block_size, num_splits):
    d_latent, d_rope = 64, 16
    dev, cache_dtype = device(), CACHE_DTYPES[cache_name]
    kv_scale = torch.tensor([0.37], device=dev) if cache_name in FP8_CACHE else None
    cache, block_table = make_paged_cache(
        spec.seq_lens, block_size, d_latent + d_rope, cache_dtype, 0.37 if kv_scale is not None else 1.0
    )
    batch, num_tokens = len(spec.seq_lens), len(spec.seq_lens) * spec.q_len
    q = torch.randn(num_tokens, num_heads, d_latent + d_rope, device=dev, dtype=torch.bfloat16)
    q_nope, q_pe = q[..., :d_latent], q[..., d_latent:]  # strided views, as vLLM passes them
    seq_lens = torch.tensor(spec.seq_lens, dtype=torch.int32, device=dev)
    scale = (d_latent + d_rope) ** -0.5
    plan = plan_decode(batch, num_heads, spec.q_len, max(spec.seq_lens), num_sms=4, num_splits=num_splits)
    out = torch.full((num_tokens, num_heads, d_latent), float("nan"), dtype=torch.bfloat16, device=dev)
    lse = torch.full((num_tokens, num_heads), float("nan"), device=dev)

    mla_decode(q_nope, q_pe, cache, block_table, seq_lens, scale, plan, kv_scale=kv_scale, out=out, lse=lse)

    ref_out, ref_lse = mla_decode_ref(q_nope, q_pe, cache, block_table, seq_lens, scale, kv_scale or 1.0,
                                      fp8_queries=plan.fp8_queries(cache_dtype))
    atol, rtol = DECODE_TOL[cache_name]
    assert_close(out, ref_out, atol=atol, rtol=rtol, name="decode out")
    assert_close(lse, ref_lse, atol=LSE_TOL[0], rtol=LSE_TOL[1], name="decode lse")


@pytest.mark.parametrize("cache_name", CACHE_DTYPES.keys())
@pytest.mark.parametrize("sm90", [False, True], ids=["plan", "sm90_plan"])
def test_decode_deepseek_v3_dims(cache_name, sm90):
    """The real DeepSeek-V3 latent sizes (512 + 64) with 16 heads, two query tokens, splits. A plan
    made for sm_90's kernels runs the Triton kernel anywhere else, with its fp8 query rounding."""
    d_latent, d_rope, num_heads, q_len = 512, 64, 16, 2
    dev, cache_dtype = device(), CACHE_DTYPES[cache_name]
    kv_scale = torch.tensor([0.05], device=dev) if cache_name in FP8_CACHE else None
    seq_lens_list = (600, 2)
    cache, block_table = make_paged_cache(
        seq_lens_list, 64, d_latent + d_rope, cache_dtype, 0.05 if kv_scale is not None else 1.0
    )
    q_nope = torch.randn(4, num_heads, d_latent, device=dev, dtype=torch.bfloat16) * 0.2
    q_pe = torch.randn(4, num_heads, d_rope, device=dev, dtype=torch.bfloat16)
    seq_lens = torch.tensor(seq_lens_list, dtype=torch.int32, device=dev)
    scale = 192**-0.5
    plan = plan_decode(2, num_heads, q_len, 600, num_sms=8, cache_dtype=cache_dtype, sm90=sm90)
    assert plan.num_splits > 1 and plan.fp8_queries(cache_dtype) == (sm90 and cache_name in FP8_CACHE)

    out, lse = mla_decode(q_nope, q_pe, cache, block_table, seq_lens, scale, plan, kv_scale=kv_scale)

    ref_out, ref_lse = mla_decode_ref(q_nope, q_pe, cache, block_table, seq_lens, scale, kv_scale or 1.0,
                                      fp8_queries=plan.fp8_queries(cache_dtype))
    assert_close(out, ref_out, atol=2e-2, rtol=2e-2, name="decode out")
    assert_close(lse, ref_lse, atol=LSE_TOL[0], rtol=LSE_TOL[1], name="decode lse")


def random_tree_masks(batch: int, num_draft: int, generator: torch.Generator) -> torch.Tensor:
    """``[B, S_q]`` int64 ancestor masks of random draft trees: token j's parent is a random
    earlier token or the prefix; each token sees itself and its ancestors."""
    masks = torch.zeros(batch, num_draft, dtype=torch.int64)
    for b in range(batch):
        for j in range(num_draft):
            parent = int(torch.randint(-1, j, (1,), generator=generator)) if j else -1
            masks[b, j] = (1 << j) | (int(masks[b, parent]) if parent >= 0 else 0)
    return masks


@pytest.mark.parametrize("cache_name", CACHE_DTYPES.keys())
@pytest.mark.parametrize("num_draft", [5, 16], ids=lambda n: f"draft{n}")
@pytest.mark.parametrize("num_splits", [1, 3], ids=lambda s: f"splits{s}")
def test_decode_tree_mask_matches_reference(cache_name, num_draft, num_splits):
    """Tree verification: draft tokens see the prefix and their ancestors only."""
    d_latent, d_rope, num_heads, block_size = 64, 16, 8, 16
    dev, cache_dtype = device(), CACHE_DTYPES[cache_name]
    seq_lens_list = (num_draft + 40, num_draft, num_draft + 17)
    kv_scale = torch.tensor([0.5], device=dev) if cache_name in FP8_CACHE else None
    cache, block_table = make_paged_cache(seq_lens_list, block_size, d_latent + d_rope, cache_dtype, 0.5 if kv_scale is not None else 1.0)
    batch, num_tokens = len(seq_lens_list), len(seq_lens_list) * num_draft
    q_nope = torch.randn(num_tokens, num_heads, d_latent, device=dev, dtype=torch.bfloat16)
    q_pe = torch.randn(num_tokens, num_heads, d_rope, device=dev, dtype=torch.bfloat16)
    seq_lens = torch.tensor(seq_lens_list, dtype=torch.int32, device=dev)
    tree = random_tree_masks(batch, num_draft, torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, (1,)))))
    plan = plan_decode(batch, num_heads, num_draft, max(seq_lens_list), num_sms=4, num_splits=num_splits)
    out = torch.full((num_tokens, num_heads, d_latent), float("nan"), dtype=torch.bfloat16, device=dev)

    _, lse = mla_decode(q_nope, q_pe, cache, block_table, seq_lens, 0.125, plan, kv_scale, out=out, tree_mask=tree.to(dev))

    ref_out, ref_lse = mla_decode_ref(q_nope, q_pe, cache, block_table, seq_lens, 0.125, kv_scale or 1.0, tree_mask=tree,
                                      fp8_queries=plan.fp8_queries(cache_dtype))
    atol, rtol = DECODE_TOL[cache_name]
    assert_close(out, ref_out, atol=atol, rtol=rtol, name="tree decode out")
    assert_close(lse, ref_lse, atol=LSE_TOL[0], rtol=LSE_TOL[1], name="tree decode lse")


@pytest.mark.parametrize("cache_name", CACHE_DTYPES.keys())
@pytest.mark.parametrize("num_splits", [1, 2], ids=lambda s: f"splits{s}")
def test_decode_ragged_queries_match_reference(cache_name, num_splits):
    """Absorbed attention for chunks of new tokens over a cached prefix: ragged query counts
    (none, all-new, long prefix), causal within each request."""
    d_latent, d_rope, num_heads, block_size = 64, 16, 4, 16
    dev, cache_dtype = device(), CACHE_DTYPES[cache_name]
    q_lens, seq_lens_list = (3, 0, 21, 1, 9), (40, 7, 21, 1, 70)
    kv_scale = torch.tensor([0.5], device=dev) if cache_name in FP8_CACHE else None
    cache, block_table = make_paged_cache(seq_lens_list, block_size, d_latent + d_rope, cache_dtype, 0.5 if kv_scale is not None else 1.0)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    num_tokens = sum(q_lens)
    q_nope = torch.randn(num_tokens, num_heads, d_latent, device=dev, dtype=torch.bfloat16)
    q_pe = torch.randn(num_tokens, num_heads, d_rope, device=dev, dtype=torch.bfloat16)
    seq_lens = torch.tensor(seq_lens_list, dtype=torch.int32, device=dev)
    plan = plan_decode(len(q_lens), num_heads, max(q_lens), max(seq_lens_list), num_sms=4, num_splits=num_splits)
    out = torch.full((num_tokens, num_heads, d_latent), float("nan"), dtype=torch.bfloat16, device=dev)

    _, lse = mla_decode(q_nope, q_pe, cache, block_table, seq_lens, 0.125, plan, kv_scale, out=out, query_start_loc=starts)

    ref_out, ref_lse = mla_decode_ref(q_nope, q_pe, cache, block_table, seq_lens, 0.125, kv_scale or 1.0,
                                      query_start_loc=starts, fp8_queries=plan.fp8_queries(cache_dtype))
    atol, rtol = DECODE_TOL[cache_name]
    assert_close(out, ref_out, atol=atol, rtol=rtol, name="ragged decode out")
    assert_close(lse, ref_lse, atol=LSE_TOL[0], rtol=LSE_TOL[1], name="ragged decode lse")


@pytest.mark.parametrize("cache_name", CACHE_DTYPES.keys())
@pytest.mark.parametrize("num_splits", [1, 2], ids=lambda s: f"splits{s}")
@pytest.mark.parametrize("ragged", [True, False], ids=["ragged", "uniform"])
def test_decode_fresh_rows_replace_cached_ones(cache_name, num_splits, ragged):
    """With ``fresh_kv`` the query tokens' own positions come from it, never from the cache: the
    cache holds NaN there, so reading it shows. The prefix is read from the cache."""
    d_latent, d_rope, num_heads, block_size = 64, 16, 4, 16
    dev, cache_dtype = device(), CACHE_DTYPES[cache_name]
    q_lens, seq_lens_list = ((3, 0, 21, 1, 9), (40, 7, 21, 1, 70)) if ragged else ((5, 5, 5), (5, 33, 17))
    kv_scale = torch.tensor([0.5], device=dev) if cache_name in FP8_CACHE else None
    cache, block_table = make_paged_cache(seq_lens_list, block_size, d_latent + d_rope, cache_dtype, 0.5 if kv_scale is not None else 1.0)
    for b, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens_list)):
        for pos in range(seq_len - q_len, seq_len):
            cache[block_table[b, pos // block_size], pos % block_size] = float("nan")
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    num_tokens = sum(q_lens)
    q_nope = torch.randn(num_tokens, num_heads, d_latent, device=dev, dtype=torch.bfloat16)
    q_pe = torch.randn(num_tokens, num_heads, d_rope, device=dev, dtype=torch.bfloat16)
    fresh = torch.randn(num_tokens, d_latent + d_rope, device=dev, dtype=torch.bfloat16)
    seq_lens = torch.tensor(seq_lens_list, dtype=torch.int32, device=dev)
    plan = plan_decode(len(q_lens), num_heads, max(q_lens), max(seq_lens_list), num_sms=4, num_splits=num_splits)
    out = torch.full((num_tokens, num_heads, d_latent), float("nan"), dtype=torch.bfloat16, device=dev)
    loc = starts if ragged else None

    _, lse = mla_decode(q_nope, q_pe, cache, block_table, seq_lens, 0.125, plan, kv_scale, out=out,
                        query_start_loc=loc, fresh_kv=fresh)

    ref_out, ref_lse = mla_decode_ref(q_nope, q_pe, cache, block_table, seq_lens, 0.125, kv_scale or 1.0,
                                      query_start_loc=loc, fp8_queries=plan.fp8_queries(cache_dtype), fresh_kv=fresh)
    atol, rtol = DECODE_TOL[cache_name]
    assert_close(out, ref_out, atol=atol, rtol=rtol, name="fresh-rows decode out")
    assert_close(lse, ref_lse, atol=LSE_TOL[0], rtol=LSE_TOL[1], name="fresh-rows decode lse")


def test_decode_chain_tree_equals_causal():
    dev = device()
    cache, table = make_paged_cache((30, 9), 16, 80, torch.bfloat16, 1.0)
    q_nope = torch.randn(8, 4, 64, device=dev, dtype=torch.bfloat16)
    q_pe = torch.randn(8, 4, 16, device=dev, dtype=torch.bfloat16)
    lens = torch.tensor([30, 9], dtype=torch.int32, device=dev)
    plan = plan_decode(2, 4, 4, 30, num_sms=1, num_splits=2)
    chain = torch.tensor([[(1 << (j + 1)) - 1 for j in range(4)]] * 2, dtype=torch.int64, device=dev)
    causal, _ = mla_decode(q_nope, q_pe, cache, table, lens, 0.1, plan)
    tree, _ = mla_decode(q_nope, q_pe, cache, table, lens, 0.1, plan, tree_mask=chain)
    assert torch.equal(causal, tree)


def test_decode_rejects_bad_input():
    dev = device()
    q_nope = torch.randn(2, 16, 96, device=dev, dtype=torch.bfloat16)
    q_pe = torch.randn(2, 16, 16, device=dev, dtype=torch.bfloat16)
    cache = torch.zeros(4, 16, 112, device=dev, dtype=torch.bfloat16)
    table = torch.zeros(2, 2, dtype=torch.int32, device=dev)
    lens = torch.tensor([3, 4], dtype=torch.int32, device=dev)
    plan = plan_decode(2, 16, 1, 4, num_sms=1)
    with pytest.raises(ValueError, match="D_latent=96"):
        mla_decode(q_nope, q_pe, cache, table, lens, 1.0, plan)
    q_nope = q_nope[..., :64]
    with pytest.raises(ValueError, match="kv_cache must be"):
        mla_decode(q_nope, q_pe, cache, table, lens, 1.0, plan)
    with pytest.raises(ValueError, match="needs kv_scale"):
        mla_decode(q_nope, q_pe, cache[..., :80].contiguous().to(torch.float8_e5m2), table, lens, 1.0, plan)
    with pytest.raises(ValueError, match="block size 24"):
        mla_decode(q_nope, q_pe, torch.zeros(4, 24, 80, device=dev, dtype=torch.bfloat16), table, lens, 1.0, plan)
    with pytest.raises(ValueError, match="int32"):
        mla_decode(q_nope, q_pe, cache[..., :80].contiguous(), table.long(), lens, 1.0, plan)
    with pytest.raises(ValueError, match=r"tree_mask must be a contiguous int64 \[B, S_q\] = \[2, 1\]"):
        mla_decode(q_nope, q_pe, cache[..., :80].contiguous(), table, lens, 1.0, plan, tree_mask=lens)
    split = plan_decode(2, 16, 1, 4, num_sms=1, num_splits=2)
    short = tuple(torch.empty(shape, device=dev) for shape in split.workspace_shapes(64))  # no room for fresh_kv
    with pytest.raises(ValueError, match="workspace must be fp32"):
        mla_decode(q_nope, q_pe, cache[..., :80].contiguous(), table, lens, 1.0, split, workspace=short,
                   fresh_kv=torch.zeros(2, 80, device=dev, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"fresh_kv must be \[T, D_latent \+ D_rope\] = \[2, 80\]"):
        mla_decode(q_nope, q_pe, cache[..., :80].contiguous(), table, lens, 1.0, plan, fresh_kv=q_nope[:, 0])
    rows = torch.empty(2, 16, 66, device=dev, dtype=torch.bfloat16)  # head stride 66: rows not in groups of four
    for out in (rows[..., :64], torch.empty(2, 16, 64, device=dev), torch.empty(2, 16, 32, device=dev)):
        with pytest.raises(ValueError, match=r"out must be torch.bfloat16 \[T, H, D_latent\] = \[2, 16, 64\]"):
            mla_decode(q_nope, q_pe, cache[..., :80].contiguous(), table, lens, 1.0, plan, out=out)


def test_plan_bounds_workspace(monkeypatch):
    from common_kernels.mla import decode_sm90_narrow, max_workspace_tokens_times_splits
    from common_kernels.mla.decode import MAX_SPLITS

    for batch in (1, 3, 17, 128, 512):
        for heads in (16, 128):
            for q_len in (1, 2):
                plan = plan_decode(batch, heads, q_len, 1 << 17, num_sms=132)
                assert plan.batch * plan.num_splits <= max_workspace_tokens_times_splits(batch, 132)
                assert 1 <= plan.num_splits
    assert plan_decode(1, 16, 1, 64, num_sms=132).num_splits == 1  # short context: no split
    assert plan_decode(1, 16, 1, 1 << 17, num_sms=132).num_splits == MAX_SPLITS
    # One wave: 8 requests x 2 row groups of 64 rows, one program per multiprocessor.
    assert plan_decode(8, 128, 1, 1 << 17, num_sms=132).num_splits == 132 // 16
    assert plan_decode(128, 16, 1, 1 << 17, num_sms=132).num_splits == 3 * 132 // 128
    assert plan_decode(8, 16, 1, 1 << 17, num_sms=132, cache_dtype=torch.float8_e4m3fn).num_splits == 132 // 8
    # sm_90's Gluon kernels: one program per multiprocessor; the narrow kernel's fp8 launches as paired
    # programs (one a multiprocessor) over splits of 256 tokens or more, else two one-warpgroup programs
    # (one with LATENTSPEED_MLA_DECODE_PAIRED=0 where splits would be shorter than 256).
    assert plan_decode(128, 16, 1, 1 << 17, num_sms=132, sm90=True).num_splits == 1
    assert plan_decode(8, 16, 2, 1 << 17, num_sms=132, sm90=True).num_splits == 132 // 8
    assert not plan_decode(128, 16, 1, 1 << 17, num_sms=132, sm90=True).paired  # bf16
    monkeypatch.delenv(decode_sm90_narrow.PAIRED_ENV, raising=False)
    assert decode_sm90_narrow.paired(True) and not decode_sm90_narrow.paired(False)
    for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
        for q_len in (1, 2):
            plan = plan_decode(128, 16, q_len, 1 << 17, num_sms=132, cache_dtype=fp8, sm90=True)
            assert (plan.num_splits, plan.paired) == (1, True)
            assert not plan_decode(128, 16, q_len, 1 << 17, num_sms=132, cache_dtype=fp8).paired  # Triton kernel
        # batch 8: 16 splits fill one program a multiprocessor; paired from 4096 tokens (256 a split)
        assert plan_decode(8, 16, 1, 4096, num_sms=132, cache_dtype=fp8, sm90=True).paired
        short = plan_decode(8, 16, 1, 4095, num_sms=132, cache_dtype=fp8, sm90=True)
        assert (short.num_splits, short.paired) == (132 // 8, False)
        # batch 1, 512 tokens: 8 splits of one tile, unpaired
        tiny = plan_decode(1, 16, 1, 512, num_sms=132, cache_dtype=fp8, sm90=True)
        assert (tiny.num_splits, tiny.paired) == (8, False)
        assert plan_decode(6, 16, 1, 6000, 132, num_splits=1, cache_dtype=fp8, sm90=True).paired  # direct
        assert not plan_decode(6, 16, 1, 200, 132, num_splits=1, cache_dtype=fp8, sm90=True).paired
        assert not plan_decode(8, 128, 1, 1 << 17, num_sms=132, cache_dtype=fp8, sm90=True).paired  # 64-row groups
    monkeypatch.setenv(decode_sm90_narrow.PAIRED_ENV, "0")
    for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
        for q_len in (1, 2):
            plan = plan_decode(128, 16, q_len, 1 << 17, num_sms=132, cache_dtype=fp8, sm90=True)
            assert (plan.num_splits, plan.paired) == (2, False)
        assert plan_decode(8, 128, 1, 1 << 17, num_sms=132, cache_dtype=fp8, sm90=True).num_splits == 132 // 16
        # Two programs would split 4096 tokens 32 ways (128 each): one program a multiprocessor.
        assert plan_decode(8, 16, 1, 4096, num_sms=132, cache_dtype=fp8, sm90=True).num_splits == 132 // 8
        assert plan_decode(128, 16, 1, 500, num_sms=132, cache_dtype=fp8, sm90=True).num_splits == 1


def test_fp8_pv_on_the_64_row_kernel_needs_long_splits_or_half_a_wave():
    """The 64-row kernel's fp8 ``P V`` is planned where every split reads at least
    ``MIN_TOKENS_PER_FP8_PV_SPLIT`` tokens or the launch has programs for more than half the
    multiprocessors; the narrow kernel's is not affected."""
    from common_kernels.mla.decode_sm90_seesaw import MIN_TOKENS_PER_FP8_PV_SPLIT

    assert MIN_TOKENS_PER_FP8_PV_SPLIT == 160
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        def plan(batch, heads, ctx, **kw):
            return plan_decode(batch, heads, 1, ctx, 132, cache_dtype=dtype, sm90=True, **kw)

        # 16, 64, 32 and 64 programs of 64, 128, 64 and 64 tokens a split
        for batch, ctx in ((1, 512), (1, 4096), (2, 512), (4, 512)):
            short = plan(batch, 128, ctx)
            assert not short.long_splits and not short.fp8_probs(dtype), (batch, ctx, short)
            assert plan(batch, 16, ctx).fp8_probs(dtype), (batch, ctx)
        for batch, ctx in ((2, 2048), (8, 512), (8, 4096), (64, 512)):  # 128 programs of 64-512 tokens a split
            assert plan(batch, 128, ctx).fp8_probs(dtype), (batch, ctx)
        assert plan(1, 128, 8192).fp8_probs(dtype)  # 64 programs of 256 tokens a split
        assert plan(1, 128, 6144).fp8_probs(dtype)  # 64 programs of 192 tokens a split
        assert plan(1, 128, 5120).fp8_probs(dtype)  # 64 programs of 160 tokens a split
        assert not plan(1, 128, 4608).fp8_probs(dtype)  # 64 programs of 144 tokens a split
        wide = plan(128, 128, 512)  # 256 programs of 512 tokens: two waves
        assert wide.num_splits == 1 and wide.fp8_probs(dtype)
        assert plan(1, 128, 6000, num_splits=1).fp8_probs(dtype)  # direct: 6000 tokens
        assert not plan(1, 128, 5000, num_splits=32).fp8_probs(dtype)  # 156 a split, 64 programs
        assert plan(1, 128, 5000, num_splits=31).fp8_probs(dtype)  # 161 a split, 62 programs
        assert plan(3, 128, 5000, num_splits=32).fp8_probs(dtype)  # 156 a split, 192 programs


def test_sm90_kernel_routing():
    """Which Gluon kernel an sm_90 launch goes to (the choice is made on any machine; the kernels
    run only on the GPU, ``tests/gpu/test_decode_sm90.py``)."""
    from common_kernels.mla import decode_sm90_narrow, decode_sm90_seesaw
    from common_kernels.mla.decode import sm90_kernel_for

    for page in (64, 128):
        for dtype in (torch.bfloat16, torch.float16, *FP8_CACHE.values()):
            assert sm90_kernel_for(64, dtype, True, page, 512, 64) is decode_sm90_seesaw
            for rows in (16, 32):
                assert sm90_kernel_for(rows, dtype, True, page, 512, 64) is decode_sm90_narrow
    for shape in ((64, torch.bfloat16, False, 0, 512, 64), (64, torch.bfloat16, True, 32, 512, 64),
                  (64, torch.bfloat16, True, 64, 256, 64), (64, torch.float32, True, 64, 512, 64)):
        assert sm90_kernel_for(*shape) is None, shape


def test_fp8_probs_on_the_sm90_kernels_over_fp8(monkeypatch):
    """``P V`` in fp8 is planned for fp8 caches on sm_90's kernels (row groups of 16 and 32 on the narrow
    kernel, of 64 on the two-phase one), each kernel's ``USE_FP8_PV`` turns its own off, and
    ``LATENTSPEED_MLA_DECODE_FP8_PV=0`` both."""
    from common_kernels.mla import decode_sm90_narrow, decode_sm90_seesaw, sm90_common

    def probs(heads, q_len, dtype, sm90=True):  # splits of 2048 tokens
        return plan_decode(4, heads, q_len, 1 << 15, 132, cache_dtype=dtype, sm90=sm90).fp8_probs(dtype)

    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        assert probs(16, 1, dtype) and probs(16, 2, dtype) and probs(16, 4, dtype) and probs(128, 1, dtype)
        assert not probs(16, 1, dtype, sm90=False) and not probs(128, 1, dtype, sm90=False)
    assert not probs(16, 1, torch.bfloat16) and not probs(128, 1, torch.float16)
    monkeypatch.setattr(decode_sm90_seesaw, "USE_FP8_PV", 0)
    assert probs(16, 1, torch.float8_e4m3fn) and not probs(128, 1, torch.float8_e4m3fn)
    monkeypatch.setattr(decode_sm90_seesaw, "USE_FP8_PV", 1)
    monkeypatch.setattr(decode_sm90_narrow, "USE_FP8_PV", 0)
    assert not probs(16, 1, torch.float8_e4m3fn) and probs(128, 1, torch.float8_e4m3fn)
    monkeypatch.setattr(decode_sm90_narrow, "USE_FP8_PV", 1)
    monkeypatch.setenv(sm90_common.FP8_PV_ENV, "0")
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        assert not probs(16, 1, dtype) and not probs(128, 1, dtype)


@pytest.mark.parametrize("fp8_dtype, half_step, subnormal_half_step",
                         [(torch.float8_e4m3fn, 2**-4, 2**-18), (torch.float8_e5m2, 2**-3, 2**-25)],
                         ids=["e4m3", "e5m2"])
def test_fp8_probs_weights_round_numerators_under_a_whole_shift(fp8_dtype, half_step, subnormal_half_step):
    """The reference of the fp8 ``P V``: each numerator ``p`` (at most 1) within the format's half
    step of the exact one (relative; absolute in the subnormals of ``256 p``: E4M3 2^-4 and 2^-18,
    E5M2 2^-3 and 2^-25), the same under any shift of the scores by whole powers of two (the
    kernel's running and per-split maxima), and exact where asked."""
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(8, 300, generator=g) * 3
    exact = torch.softmax(scores, dim=-1)
    weights = fp8_probs_weights(scores, fp8_dtype=fp8_dtype)
    scaled = scores / math.log(2)
    norm = torch.exp2(scaled - scaled.amax(-1, keepdim=True).ceil()).sum(-1, keepdim=True)  # sum of the p
    assert ((weights - exact).abs() <= half_step * exact + subnormal_half_step / norm + 1e-9).all()
    assert (weights != exact).float().mean() > 0.5  # rounded, not passed through
    for shift in (-3, 1, 7):
        shifted = fp8_probs_weights(scores + shift * math.log(2), fp8_dtype=fp8_dtype)
        torch.testing.assert_close(shifted, weights, rtol=1e-5, atol=0)
    keep = torch.rand(8, 300, generator=g) < 0.3
    mixed = fp8_probs_weights(scores, keep, fp8_dtype)
    torch.testing.assert_close(mixed[keep], exact[keep], rtol=1e-5, atol=0)
    torch.testing.assert_close(mixed[~keep], weights[~keep])


@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_fp8_probs_spread_bounds_the_flips_of_nearby_numerators(fp8_dtype):
    """Numerators moved by less than the margin (relative) round to other fp8 values only at keys
    with a spread, and by at most that spread over the sum; most keys have none; exact keys none."""
    g = torch.Generator().manual_seed(2)
    margin = 2.0**-7
    scores = torch.randn(8, 300, generator=g) * 3
    spread = fp8_probs_spread(scores, fp8_dtype=fp8_dtype, margin=margin)
    moved = scores + torch.log1p((torch.rand(8, 300, generator=g) - 0.5) * margin)
    shift = (scores / math.log(2)).amax(-1, keepdim=True).ceil()
    p, p_moved = (torch.exp2(x / math.log(2) - shift) for x in (scores, moved))
    norm = p.sum(-1, keepdim=True)
    change = (fp8_probs_weights(moved, fp8_dtype=fp8_dtype) * p_moved.sum(-1, keepdim=True) / norm
              - fp8_probs_weights(scores, fp8_dtype=fp8_dtype)).abs()
    flipped = change > 1e-6 / norm
    assert flipped.any()  # the perturbation does cross midpoints
    assert (spread[flipped] > 0).all()
    assert (change <= spread + 1e-6 / norm).all()
    assert 0 < (spread > 0).float().mean() < 0.25
    keep = torch.rand(8, 300, generator=g) < 0.3
    assert (fp8_probs_spread(scores, keep, fp8_dtype, margin)[keep] == 0).all()


def test_mla_decode_ref_flip_bound_covers_scores_off_in_their_last_bits(monkeypatch):
    """``flip_bound``: with the scores scaled by 1 + 2^-8 (within a margin of 2^-5 for scores up to
    8; these stay below 4) the fp8 ``P V`` output moves beyond its sum's share (at most 2 %) only
    where the bound allows, and it does move there; the buffer is refused without ``fp8_probs``."""
    monkeypatch.setattr(reference, "FP8_PROBS_MARGIN", 2.0**-5)
    g = torch.Generator().manual_seed(3)
    seq_lens = (63, 300, 1)
    cache, table = make_paged_cache(seq_lens, 64, 576, torch.float8_e5m2, 0.02)
    q_nope, q_pe = torch.randn(3, 16, 512, generator=g) * 0.1, torch.randn(3, 16, 64, generator=g)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    bound = torch.zeros(3, 16, 512)
    out, _ = mla_decode_ref(q_nope, q_pe, cache, table, lens, 192**-0.5, 0.02, fp8_queries=True, fp8_probs=True,
                            flip_bound=bound)
    moved, _ = mla_decode_ref(q_nope, q_pe, cache, table, lens, 192**-0.5 * (1 + 2**-8), 0.02, fp8_queries=True,
                              fp8_probs=True)
    beyond_sum = (moved - out).abs() - 2e-2 * out.abs() - 1e-6
    assert (beyond_sum > 0).any()
    assert (beyond_sum <= bound).all()
    assert (bound >= 0).all() and (bound[beyond_sum > 0] > 0).all()
    with pytest.raises(ValueError, match="flip_bound must be fp32"):
        mla_decode_ref(q_nope, q_pe, cache, table, lens, 192**-0.5, 0.02, fp8_probs=False, flip_bound=bound)


def test_fp8_probs_rounds_p_in_the_caches_format():
    """``mla_decode_ref(..., fp8_probs=True)`` rounds ``P`` to the fp8 cache's own format: one set
    of values held exactly by an E5M2 and by an E4M3 cache gives the same exact outputs but
    different ones with ``fp8_probs``; a 16-bit cache, whose ``P V`` is never in fp8, is refused."""
    g = torch.Generator().manual_seed(1)
    seq_lens = (300, 77)
    q_nope, q_pe = torch.randn(2, 16, 512, generator=g), torch.randn(2, 16, 64, generator=g)
    e5m2, table = make_paged_cache(seq_lens, 64, 576, torch.float8_e5m2, 1.0)
    values = e5m2.float().masked_fill(e5m2.float().abs() < 2**-6, 0.0)  # within E4M3's normal range
    caches = [values.to(dtype) for dtype in (torch.float8_e5m2, torch.float8_e4m3fn)]
    assert torch.equal(caches[0].float().nan_to_num(), caches[1].float().nan_to_num())
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    outs = {probs: [mla_decode_ref(q_nope, q_pe, cache, table, lens, 192**-0.5, 0.5, fp8_queries=True,
                                   fp8_probs=probs)[0] for cache in caches] for probs in (False, True)}
    torch.testing.assert_close(outs[False][0], outs[False][1], rtol=0, atol=0)
    assert not torch.equal(outs[True][0], outs[True][1])
    for out in outs[True]:
        assert not torch.equal(out, outs[False][0])
    with pytest.raises(ValueError, match="fp8_probs rounds P to an fp8 cache's format"):
        mla_decode_ref(q_nope, q_pe, values.bfloat16(), table, lens, 192**-0.5, fp8_probs=True)


def test_narrow_kernel_bulk_copies_only_contiguous_fp8_pages(monkeypatch):
    """The narrow kernel's TMA tiles (``tma_options``): fp8 caches whose pages lie back to back get
    descriptors over the cache rows (boxes of 64 rows by 128 bytes and by the RoPE part); 16-bit
    caches, caches with gaps between pages or rows not 16-byte aligned, and
    ``LATENTSPEED_MLA_DECODE_TMA=0`` keep ``cp.async``."""
    from common_kernels.mla import decode_sm90_narrow

    for page in (64, 128):
        for dtype in FP8_CACHE.values():
            cache = torch.zeros(6, page, 576, dtype=dtype)
            options = decode_sm90_narrow.tma_options(cache)
            latent, rope = options["kc_desc"], options["kp_desc"]
            assert options["TMA_BOX"] == 128 and list(latent.block_shape) == [64, 128]
            assert list(rope.block_shape) == [64, 64]
            assert list(latent.shape) == [6 * page, 576] and list(latent.strides) == [576, 1]
            assert latent.base.data_ptr() == cache.data_ptr() and rope.base.data_ptr() == cache.data_ptr()
            gapped = torch.zeros(6, page + 1, 576, dtype=dtype)[:, :page]
            assert decode_sm90_narrow.tma_options(gapped) == {}
            assert decode_sm90_narrow.tma_options(torch.zeros(6, page, 584, dtype=dtype)[..., :576]) == {}
        assert decode_sm90_narrow.tma_options(torch.zeros(6, page, 576, dtype=torch.bfloat16)) == {}
    monkeypatch.setenv(decode_sm90_narrow.TMA_ENV, "0")
    assert decode_sm90_narrow.tma_options(torch.zeros(6, 64, 576, dtype=torch.float8_e4m3fn)) == {}


def test_narrow_kernel_pairs_warpgroups_over_bulk_copies():
    """``launch_options`` for paired programs (``DecodePlan.paired``): fp8 caches that get bulk
    copies launch two warpgroups over one ring of ``PAIRED_BUFS`` slots, with a register cap for
    both; 16-bit caches, fp8 caches without bulk copies and unpaired plans launch one warpgroup a
    program."""
    from common_kernels.mla import decode_sm90_narrow as narrow

    for dtype in FP8_CACHE.values():
        options = narrow.launch_options(torch.zeros(6, 64, 576, dtype=dtype), True, True)
        assert (options["CONSUMERS"], options["NUM_BUFS"], options["maxnreg"]) == (2, narrow.PAIRED_BUFS,
                                                                                   narrow.PAIRED_REGS)
        assert options["FP8_PV"] and options["num_warps"] == narrow.NUM_WARPS and "kc_desc" in options
        gapped = narrow.launch_options(torch.zeros(6, 65, 576, dtype=dtype)[:, :64], True, True)
        assert "CONSUMERS" not in gapped and gapped["NUM_BUFS"] == narrow.NUM_BUFS
        unpaired = narrow.launch_options(torch.zeros(6, 64, 576, dtype=dtype), True, False)
        assert "CONSUMERS" not in unpaired and "maxnreg" not in unpaired and unpaired["TMA_BOX"] == narrow.TMA_BOX
    assert narrow.launch_options(torch.zeros(6, 64, 576, dtype=torch.bfloat16), False, True) == dict(
        NUM_BUFS=narrow.NUM_BUFS, num_warps=narrow.NUM_WARPS, FP8_PV=False)


@pytest.mark.parametrize("cache_name", CACHE_DTYPES.keys())
@pytest.mark.parametrize("block_size", [16, 64], ids=lambda b: f"page{b}")
def test_cache_write_matches_reference(cache_name, block_size):
    d_latent, d_rope, num_tokens = 64, 16, 37
    dev, cache_dtype = device(), CACHE_DTYPES[cache_name]
    kv_c = torch.randn(num_tokens, d_latent, device=dev, dtype=torch.bfloat16)
    k_pe = torch.randn(num_tokens, 1, d_rope, device=dev, dtype=torch.bfloat16)
    num_blocks = 6
    slots = torch.randperm(num_blocks * block_size, device=dev)[:num_tokens]
    slots[::7] = -1  # padding tokens are skipped
    kv_scale = torch.tensor([0.11], device=dev)
    cache = torch.full((num_blocks, block_size, d_latent + d_rope), float("nan"), device=dev).to(cache_dtype)
    expected = cache.clone()

    write_latent_cache(kv_c, k_pe, cache, slots, kv_scale=kv_scale)

    write_latent_cache_ref(kv_c, k_pe.squeeze(1), expected, slots, kv_scale)
    assert_close(cache.float(), expected.float(), atol=0.0, rtol=0.0, name="cache")


@pytest.mark.parametrize("cache_name", FP8_CACHE.keys())
def test_cache_write_counts_saturation_and_nonfinite(cache_name):
    dev, cache_dtype = device(), FP8_CACHE[cache_name]
    fp8_max = torch.finfo(cache_dtype).max
    kv_c = torch.randn(4, 32, device=dev, dtype=torch.bfloat16)
    k_pe = torch.randn(4, 16, device=dev, dtype=torch.bfloat16)
    kv_c[0, 3] = 4 * fp8_max  # saturates at scale 2
    kv_c[2, 5] = -3 * fp8_max
    k_pe[1, 0] = float("nan")
    kv_c[3, 0] = float("inf")
    cache = torch.zeros(2, 16, 48, device=dev).to(cache_dtype)
    stats = torch.zeros(2, dtype=torch.int32, device=dev)

    write_latent_cache(kv_c, k_pe, cache, torch.arange(4, device=dev), torch.tensor([2.0], device=dev), stats)

    assert stats.tolist() == [2, 2]
    assert cache[0, 0, 3].float().item() == fp8_max
    assert cache[0, 2, 5].float().item() == -fp8_max


def test_cache_write_rejects_mismatched_cache():
    dev = device()
    kv_c = torch.randn(2, 64, device=dev, dtype=torch.bfloat16)
    k_pe = torch.randn(2, 16, device=dev, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"\[num_blocks, block_size, 80\]"):
        write_latent_cache(kv_c, k_pe, torch.zeros(2, 16, 64, device=dev, dtype=torch.bfloat16), torch.arange(2))
    with pytest.raises(ValueError, match="needs kv_scale"):
        write_latent_cache(kv_c, k_pe, torch.zeros(2, 16, 80, device=dev).to(torch.float8_e4m3fn), torch.arange(2))
    with pytest.raises(ValueError, match="must be fp8 or match"):
        write_latent_cache(kv_c, k_pe, torch.zeros(2, 16, 80, device=dev, dtype=torch.float16), torch.arange(2))


PREFILL_CASES = {
    # name: (query lengths, key lengths, causal)
    "new_tokens_causal": ((5, 17, 1, 33), (5, 17, 1, 33), True),
    "context_chunk": ((5, 17, 3), (40, 0, 9), False),
    "longer_keys_causal": ((3, 20), (19, 50), True),
}


@pytest.mark.parametrize("case", PREFILL_CASES.values(), ids=PREFILL_CASES.keys())
@pytest.mark.parametrize("d_qk,d_v", [(192, 128), (64, 32)], ids=["qk192_v128", "qk64_v32"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_varlen_attention_matches_reference(case, d_qk, d_v, dtype):
    q_lens, k_lens, causal = case
    dev, num_heads = device(), 3
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    cu_k = torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    q = torch.randn(sum(q_lens), num_heads, d_qk, device=dev, dtype=dtype)
    kv = torch.randn(sum(k_lens), num_heads, d_qk + d_v, device=dev, dtype=dtype)
    k, v = kv[..., :d_qk], kv[..., d_qk:]  # non-contiguous, as vLLM's split views
    out = torch.full((sum(q_lens), num_heads, d_v), float("nan"), device=dev, dtype=dtype)
    scale = d_qk**-0.5

    got, lse = varlen_attention(q, k, v, cu_q, cu_k, max(q_lens), scale, causal, return_lse=True, out=out)

    ref, ref_lse = varlen_attention_ref(q, k, v, cu_q, cu_k, scale, causal)
    assert got.data_ptr() == out.data_ptr()
    assert lse.shape == (num_heads, sum(q_lens)) and lse.is_contiguous()
    tol = 2e-2 if dtype == torch.bfloat16 else 5e-3
    assert_close(got, ref, atol=tol, rtol=tol, name="prefill out")
    assert_close(lse, ref_lse, atol=LSE_TOL[0], rtol=LSE_TOL[1], name="prefill lse")


@pytest.mark.parametrize("shared_memory,config", [
    (227 * 1024, (128, 64, 8, 3)),  # sm_90: three stages, the fastest measured on an H100
    (163 * 1024, (128, 64, 8, 2)),  # sm_80
    (99 * 1024, (64, 32, 4, 2)),  # sm_86 / sm_89
])
def test_prefill_config_is_the_first_that_fits(shared_memory, config):
    assert prefill_config(192, 128, 2, shared_memory) == config
    assert shared_memory_needed(config, 192, 128, 2) <= shared_memory


def test_prefill_config_names_a_shortfall_of_shared_memory():
    with pytest.raises(ValueError, match="shared memory.*49152 bytes"):
        prefill_config(192, 128, 2, 48 * 1024)
    with pytest.raises(ValueError, match="head sizes 1024/512"):
        prefill_config(1024, 512, 2, 227 * 1024)


def test_split_head_dim():
    assert split_head_dim(192) == (128, 64)
    assert split_head_dim(128) == (128, 0)
    for bad in (96 + 8, 200, 8):
        with pytest.raises(ValueError, match=f"head size {bad}"):
            split_head_dim(bad)
