"""The Gluon decode kernel for Hopper (``common_kernels/mla/decode_sm90.py``) on an sm_90 GPU,
against the fp32 reference and against the Triton kernel it replaces there. It cannot run in
the interpreter; ``benchmarks/hopper_compile.py`` compiles it on any machine.

    pytest tests/gpu/test_decode_sm90.py -q          (skipped without an sm_90 GPU)

The decode tests of ``test_kernels_full_size.py`` at 128 heads over a bf16 cache (tree masks,
ragged queries, empty requests) run this kernel too; here are the launches they leave out.
"""

import pytest
import torch

from common_kernels.mla import decode, mla_decode, plan_decode
from common_kernels.mla.reference import mla_decode_ref
from tests.common_kernels.test_mla import make_paged_cache
from tests.helpers import assert_close

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                                reason="needs an sm_90 GPU")
SEQ_LENS = (4097, 1, 2900, 0, 63, 6000)


def _inputs(cache_dtype, page, q_dtype, kv_scale, num_heads=128, q_len=1):
    cache, table = make_paged_cache(SEQ_LENS, page, 576, cache_dtype, kv_scale)
    tokens = len(SEQ_LENS) * q_len
    q_nope = torch.randn(tokens, num_heads, 512, device="cuda", dtype=q_dtype) * 0.1
    q_pe = torch.randn(tokens, num_heads, 64, device="cuda", dtype=q_dtype)
    return q_nope, q_pe, cache, table, torch.tensor(SEQ_LENS, dtype=torch.int32, device="cuda")


def _decode(monkeypatch, sm90, *args, **kwargs):
    monkeypatch.setenv("LATENTSPEED_MLA_DECODE_SM90", "1" if sm90 else "0")
    out = torch.full_like(args[0], float("nan"))
    _, lse = mla_decode(*args, out=out, **kwargs)
    return out, lse


def test_dispatch(monkeypatch):
    """64-row groups over a paged bf16/fp16/fp8 cache go to the Gluon kernel; the rest stays Triton,
    and so does everything with LATENTSPEED_MLA_DECODE_SM90=0."""
    bf16 = torch.empty(4, 64, 576, device="cuda", dtype=torch.bfloat16)
    monkeypatch.setenv("LATENTSPEED_MLA_DECODE_SM90", "0")
    assert not decode._takes_sm90_kernel(bf16, 64, 64)
    monkeypatch.delenv("LATENTSPEED_MLA_DECODE_SM90")
    assert decode._takes_sm90_kernel(bf16, 64, 64)
    assert decode._takes_sm90_kernel(bf16.half(), 64, 64)
    assert not decode._takes_sm90_kernel(bf16, 64, 16)  # 16-row groups
    assert decode._takes_sm90_kernel(bf16.to(torch.float8_e4m3fn), 64, 64)
    assert decode._takes_sm90_kernel(bf16.to(torch.float8_e5m2), 64, 64)
    assert not decode._takes_sm90_kernel(bf16[0], 64, 64)  # dense keys (fresh_kv)
    assert not decode._takes_sm90_kernel(bf16[:, :32], 64, 64)  # 32-token pages
    assert not decode._takes_sm90_kernel(torch.empty(4, 64, 320, device="cuda", dtype=torch.bfloat16), 64, 64)


CACHES = {"bf16": (torch.bfloat16, torch.bfloat16), "fp16": (torch.float16, torch.float16),
          "e4m3": (torch.float8_e4m3fn, torch.bfloat16), "e5m2": (torch.float8_e5m2, torch.bfloat16)}


@pytest.mark.parametrize("cache_name", CACHES)
@pytest.mark.parametrize("page", [64, 128], ids=lambda p: f"page{p}")
@pytest.mark.parametrize("num_splits", [1, None], ids=["direct", "planned"])
@pytest.mark.parametrize("q_len", [1, 2], ids=lambda q: f"q{q}")
def test_matches_reference_and_triton(monkeypatch, cache_name, page, num_splits, q_len):
    """fp8 caches: the reference rounds the queries as both kernels do (``fp8_queries``)."""
    cache_dtype, q_dtype = CACHES[cache_name]
    fp8 = cache_dtype.itemsize == 1
    kv_scale = torch.tensor([0.02], device="cuda") if fp8 else None
    q_nope, q_pe, cache, table, lens = _inputs(cache_dtype, page, q_dtype, 0.02 if fp8 else 1.0, q_len=q_len)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    plan = plan_decode(len(SEQ_LENS), 128, q_len, max(SEQ_LENS), sms, num_splits=num_splits, cache_dtype=cache_dtype)
    args = (q_nope, q_pe, cache, table, lens, 192**-0.5, plan, kv_scale)
    out, lse = _decode(monkeypatch, True, *args)
    ref, ref_lse = mla_decode_ref(*args[:6], kv_scale if fp8 else 1.0, fp8_queries=fp8)
    assert_close(out, ref, atol=1e-2, rtol=2e-2, name="sm90 decode out")
    assert_close(lse, ref_lse, atol=2e-3, rtol=2e-3, name="sm90 decode lse")
    triton_out, triton_lse = _decode(monkeypatch, False, *args)
    assert_close(out, triton_out, atol=1e-2, rtol=2e-2, name="sm90 against Triton out")
    assert_close(lse, triton_lse, atol=2e-3, rtol=2e-3, name="sm90 against Triton lse")


def test_extend_prefix_with_fresh_rows(monkeypatch):
    """``fresh_kv`` over a bf16 cache: the prefix launch is the Gluon kernel (PREFIX_ONLY, ragged
    queries), the new rows' launch the Triton one; the cache holds NaN at the new positions."""
    q_lens, prefix = (128, 1, 77, 0), (4000, 0, 900, 33)
    seq_lens = [p + q for p, q in zip(prefix, q_lens)]
    cache, table = make_paged_cache(seq_lens, 64, 576, torch.bfloat16, 1.0)
    for b, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        for pos in range(seq_len - q_len, seq_len):
            cache[table[b, pos // 64], pos % 64] = float("nan")
    tokens = sum(q_lens)
    q_nope = torch.randn(tokens, 128, 512, device="cuda", dtype=torch.bfloat16) * 0.1
    q_pe = torch.randn(tokens, 128, 64, device="cuda", dtype=torch.bfloat16)
    fresh = torch.randn(tokens, 576, device="cuda", dtype=torch.bfloat16)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    plan = plan_decode(len(q_lens), 128, max(q_lens), max(seq_lens), sms)
    args = (q_nope, q_pe, cache, table, lens, 192**-0.5, plan)
    out, lse = _decode(monkeypatch, True, *args, query_start_loc=starts, fresh_kv=fresh)
    ref, ref_lse = mla_decode_ref(*args[:6], query_start_loc=starts, fresh_kv=fresh)
    assert_close(out, ref, atol=1e-2, rtol=2e-2, name="sm90 extend out")
    assert_close(lse, ref_lse, atol=2e-3, rtol=2e-3, name="sm90 extend lse")
