"""The Gluon decode kernels for Hopper (``common_kernels/mla/decode_sm90_seesaw.py`` for 64-row
groups, ``decode_sm90_narrow.py`` for 16 and 32) on an sm_90 GPU, against the fp32 reference and against the Triton kernel they replace there. They cannot run in the interpreter;
``benchmarks/hopper_compile.py`` compiles them on any machine.

    pytest tests/gpu/test_decode_sm90.py -q          (skipped without an sm_90 GPU)

The decode tests of ``test_kernels_full_size.py`` (tree masks, ragged queries, empty requests)
run these kernels too; here are the launches they leave out.
"""

import pytest
import torch

from common_kernels.mla import decode, decode_sm90_narrow, decode_sm90_seesaw, mla_decode, plan_decode, sm90_kernels_apply
from common_kernels.mla.reference import mla_decode_ref
from tests.common_kernels.test_mla import make_paged_cache
from tests.helpers import assert_close, fp8_flip_bound

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                                reason="needs an sm_90 GPU")
SEQ_LENS = (4097, 1, 2900, 0, 63, 6000)


def _inputs(cache_dtype, page, q_dtype, kv_scale, num_heads=128, q_len=1, seq_lens=SEQ_LENS):
    cache, table = make_paged_cache(seq_lens, page, 576, cache_dtype, kv_scale)
    tokens = len(seq_lens) * q_len
    q_nope = torch.randn(tokens, num_heads, 512, device="cuda", dtype=q_dtype) * 0.1
    q_pe = torch.randn(tokens, num_heads, 64, device="cuda", dtype=q_dtype)
    return q_nope, q_pe, cache, table, torch.tensor(seq_lens, dtype=torch.int32, device="cuda")


def _decode(monkeypatch, sm90, *args, **kwargs):
    monkeypatch.setenv("LATENTSPEED_MLA_DECODE_SM90", "1" if sm90 else "0")
    out = torch.full_like(args[0], float("nan"))
    _, lse = mla_decode(*args, out=out, **kwargs)
    return out, lse


def test_dispatch(monkeypatch):
    """Paged bf16/fp16/fp8 caches with 64-token pages: 64-row groups go to ``decode_sm90_seesaw``,
    16 and 32 to ``decode_sm90_narrow``; dense keys, other pages and other widths stay Triton, and
    so does everything with LATENTSPEED_MLA_DECODE_SM90=0."""
    for dtype in (torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2):
        assert decode.sm90_kernel_for(64, dtype, True, 64, 512, 64) is decode_sm90_seesaw
        assert decode.sm90_kernel_for(64, dtype, True, 128, 512, 64) is decode_sm90_seesaw
        assert decode.sm90_kernel_for(16, dtype, True, 128, 512, 64) is decode_sm90_narrow
        assert decode.sm90_kernel_for(32, dtype, True, 64, 512, 64) is decode_sm90_narrow
        assert sm90_kernels_apply(torch.device("cuda"), dtype, 64, 512, 64)
    assert decode.sm90_kernel_for(64, torch.bfloat16, False, 0, 512, 64) is None  # dense keys (fresh_kv)
    assert decode.sm90_kernel_for(16, torch.bfloat16, True, 32, 512, 64) is None  # 32-token pages
    assert decode.sm90_kernel_for(64, torch.bfloat16, True, 64, 256, 64) is None
    assert not sm90_kernels_apply(torch.device("cuda"), torch.bfloat16, 32, 512, 64)
    monkeypatch.setenv("LATENTSPEED_MLA_DECODE_SM90", "0")
    assert not sm90_kernels_apply(torch.device("cuda"), torch.bfloat16, 64, 512, 64)


CACHES = {"bf16": (torch.bfloat16, torch.bfloat16), "fp16": (torch.float16, torch.float16),
          "e4m3": (torch.float8_e4m3fn, torch.bfloat16), "e5m2": (torch.float8_e5m2, torch.bfloat16)}


@pytest.mark.parametrize("cache_name", CACHES)
@pytest.mark.parametrize("page", [64, 128], ids=lambda p: f"page{p}")
@pytest.mark.parametrize("num_splits", [1, None], ids=["direct", "planned"])
@pytest.mark.parametrize("q_len", [1, 2], ids=lambda q: f"q{q}")
@pytest.mark.parametrize("num_heads", [128, 16], ids=lambda h: f"H{h}")
def test_matches_reference_and_triton(monkeypatch, cache_name, page, num_splits, q_len, num_heads):
    """128 heads: 64-row groups; 16 heads: 16 and 32. fp8 caches: the reference rounds the
    queries as both kernels do (``fp8_queries``), and the softmax numerators as both kernels do
    (``fp8_probs``, in the cache's format); the Triton kernel runs the same plan, without the latter."""
    _check_against_reference_and_triton(monkeypatch, cache_name, page, num_splits, q_len, num_heads, SEQ_LENS,
                                        expect_fp8_probs=True)


@pytest.mark.parametrize("cache_name", ["e4m3", "e5m2"])
def test_64_row_kernel_widens_p_v_over_a_small_launch(monkeypatch, cache_name):
    """128 heads, one request of 700 tokens: 11 splits of 63 tokens make 22 programs, where the
    64-row kernel's plan widens ``V`` to fp16 (``decode_sm90_seesaw.fp8_pv_pays``)."""
    _check_against_reference_and_triton(monkeypatch, cache_name, 64, None, 1, 128, (700,), expect_fp8_probs=False)


def _check_against_reference_and_triton(monkeypatch, cache_name, page, num_splits, q_len, num_heads, seq_lens,
                                        expect_fp8_probs):
    """``expect_fp8_probs``: whether an fp8 cache's plan runs ``P V`` in fp8."""
    cache_dtype, q_dtype = CACHES[cache_name]
    fp8 = cache_dtype.itemsize == 1
    kv_scale = torch.tensor([0.02], device="cuda") if fp8 else None
    q_nope, q_pe, cache, table, lens = _inputs(cache_dtype, page, q_dtype, 0.02 if fp8 else 1.0, num_heads, q_len,
                                               seq_lens)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    plan = plan_decode(len(seq_lens), num_heads, q_len, max(seq_lens), sms, num_splits=num_splits,
                       cache_dtype=cache_dtype, sm90=True)
    assert plan.fp8_queries(cache_dtype) == fp8
    args = (q_nope, q_pe, cache, table, lens, 192**-0.5, plan, kv_scale)
    out, lse = _decode(monkeypatch, True, *args)
    fp8_probs = plan.fp8_probs(cache_dtype)
    assert fp8_probs == (fp8 and expect_fp8_probs), plan
    bound = fp8_flip_bound(q_nope, fp8_probs)
    ref, ref_lse = mla_decode_ref(*args[:6], kv_scale if fp8 else 1.0, fp8_queries=fp8, fp8_probs=fp8_probs,
                                  flip_bound=bound)
    assert_close(out, ref, atol=1e-2, rtol=2e-2, name="sm90 decode out", slack=bound)
    assert_close(lse, ref_lse, atol=2e-3, rtol=2e-3, name="sm90 decode lse")
    triton_out, triton_lse = _decode(monkeypatch, False, *args)
    if fp8_probs:  # the Triton kernel's P V is not in fp8: held to the reference without that rounding
        exact, _ = mla_decode_ref(*args[:6], kv_scale, fp8_queries=True)
        assert_close(triton_out, exact, atol=1e-2, rtol=2e-2, name="Triton decode out")
    else:
        assert_close(out, triton_out, atol=1e-2, rtol=2e-2, name="sm90 against Triton out")
    assert_close(lse, triton_lse, atol=2e-3, rtol=2e-3, name="sm90 against Triton lse")


@pytest.mark.parametrize("num_heads, q_lens, cache_name, num_splits",
                         [(128, (128, 1, 77, 0), "bf16", None), (16, (2, 1, 2, 0), "bf16", None),
                          (16, (2, 1, 2, 0), "e4m3", 1)], ids=["H128", "H16", "H16-e4m3-paired"])
def test_extend_prefix_with_fresh_rows(monkeypatch, num_heads, q_lens, cache_name, num_splits):
    """``fresh_kv``: the prefix launch is a Gluon kernel (PREFIX_ONLY, ragged queries; 64-row
    groups at 128 heads, 32 at 16, over the E4M3 cache with one split as paired programs), the new
    rows' launch the Triton one; the cache holds NaN at the new positions."""
    cache_dtype, q_dtype = CACHES[cache_name]
    fp8 = cache_dtype.itemsize == 1
    kv_scale = torch.tensor([0.02], device="cuda") if fp8 else None
    prefix = (4000, 0, 900, 33)
    seq_lens = [p + q for p, q in zip(prefix, q_lens)]
    cache, table = make_paged_cache(seq_lens, 64, 576, cache_dtype, 0.02 if fp8 else 1.0)
    for b, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        for pos in range(seq_len - q_len, seq_len):
            cache[table[b, pos // 64], pos % 64] = float("nan")
    tokens = sum(q_lens)
    q_nope = torch.randn(tokens, num_heads, 512, device="cuda", dtype=q_dtype) * 0.1
    q_pe = torch.randn(tokens, num_heads, 64, device="cuda", dtype=q_dtype)
    fresh = torch.randn(tokens, 576, device="cuda", dtype=q_dtype)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    monkeypatch.delenv(decode_sm90_narrow.PAIRED_ENV, raising=False)
    plan = plan_decode(len(q_lens), num_heads, max(q_lens), max(seq_lens), sms, num_splits=num_splits,
                       cache_dtype=cache_dtype, sm90=True)
    assert plan.paired == fp8
    args = (q_nope, q_pe, cache, table, lens, 192**-0.5, plan, kv_scale)
    out, lse = _decode(monkeypatch, True, *args, query_start_loc=starts, fresh_kv=fresh)
    fp8_probs = plan.fp8_probs(cache_dtype)
    bound = fp8_flip_bound(q_nope, fp8_probs)
    ref, ref_lse = mla_decode_ref(*args[:6], kv_scale if fp8 else 1.0, query_start_loc=starts, fresh_kv=fresh,
                                  fp8_queries=fp8, fp8_probs=fp8_probs, flip_bound=bound)
    assert_close(out, ref, atol=1e-2, rtol=2e-2, name="sm90 extend out", slack=bound)
    assert_close(lse, ref_lse, atol=2e-3, rtol=2e-3, name="sm90 extend lse")


@pytest.mark.parametrize("cache_name", ["bf16", "e4m3"])
@pytest.mark.parametrize("num_splits", [1, None], ids=["direct", "planned"])
def test_narrow_tree_mask(monkeypatch, cache_name, num_splits):
    """Tree verification on the 32-row kernel: 16 heads, 2 draft tokens, each seeing only itself;
    over the fp8 cache paired programs with direct splits, one warpgroup a program with the
    planned ones (230 tokens a split)."""
    cache_dtype, q_dtype = CACHES[cache_name]
    fp8 = cache_dtype.itemsize == 1
    kv_scale = torch.tensor([0.02], device="cuda") if fp8 else None
    seq_lens = (4097, 2, 2900, 63, 6000)
    q_nope, q_pe, cache, table, lens = _inputs(cache_dtype, 64, q_dtype, 0.02 if fp8 else 1.0, 16, 2, seq_lens)
    tree = torch.tensor([[1, 2]] * len(seq_lens), dtype=torch.int64, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    monkeypatch.delenv(decode_sm90_narrow.PAIRED_ENV, raising=False)
    plan = plan_decode(len(seq_lens), 16, 2, max(seq_lens), sms, num_splits=num_splits, cache_dtype=cache_dtype,
                       sm90=True)
    assert plan.paired == (fp8 and num_splits == 1)
    args = (q_nope, q_pe, cache, table, lens, 192**-0.5, plan, kv_scale)
    out, lse = _decode(monkeypatch, True, *args, tree_mask=tree)
    fp8_probs = plan.fp8_probs(cache_dtype)
    bound = fp8_flip_bound(q_nope, fp8_probs)
    ref, ref_lse = mla_decode_ref(*args[:6], kv_scale if fp8 else 1.0, tree_mask=tree.cpu(), fp8_queries=fp8,
                                  fp8_probs=fp8_probs, flip_bound=bound)
    assert_close(out, ref, atol=1e-2, rtol=2e-2, name="narrow tree out", slack=bound)
    assert_close(lse, ref_lse, atol=2e-3, rtol=2e-3, name="narrow tree lse")


@pytest.mark.parametrize("cache_name", ["e4m3", "e5m2"])
@pytest.mark.parametrize("num_splits", [1, None], ids=["direct", "planned"])
@pytest.mark.parametrize("q_len", [1, 2], ids=lambda q: f"q{q}")
@pytest.mark.parametrize("paired", ["1", "0"], ids=["paired", "unpaired"])
def test_narrow_fp8_paired_or_not(monkeypatch, cache_name, num_splits, q_len, paired):
    """fp8 caches at 16 heads, both ways the narrow kernel runs them: paired programs (two warpgroups
    taking turns at the tiles of one ring, merged in shared memory; requests of one tile leave the
    second warpgroup without keys; the plan's choice here) and, with
    ``LATENTSPEED_MLA_DECODE_PAIRED=0``, one warpgroup a program; each against the reference with the
    plan made under that setting."""
    monkeypatch.setenv(decode_sm90_narrow.PAIRED_ENV, paired)
    cache_dtype, q_dtype = CACHES[cache_name]
    kv_scale = torch.tensor([0.02], device="cuda")
    q_nope, q_pe, cache, table, lens = _inputs(cache_dtype, 64, q_dtype, 0.02, 16, q_len)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    plan = plan_decode(len(SEQ_LENS), 16, q_len, max(SEQ_LENS), sms, num_splits=num_splits, cache_dtype=cache_dtype,
                       sm90=True)
    assert plan.paired == (paired == "1")
    assert ("CONSUMERS" in decode_sm90_narrow.launch_options(cache, True, plan.paired)) == plan.paired
    args = (q_nope, q_pe, cache, table, lens, 192**-0.5, plan, kv_scale)
    out, lse = _decode(monkeypatch, True, *args)
    bound = fp8_flip_bound(q_nope, True)
    ref, ref_lse = mla_decode_ref(*args[:6], kv_scale, fp8_queries=True, fp8_probs=True, flip_bound=bound)
    assert_close(out, ref, atol=1e-2, rtol=2e-2, name="narrow fp8 out", slack=bound)
    assert_close(lse, ref_lse, atol=2e-3, rtol=2e-3, name="narrow fp8 lse")
