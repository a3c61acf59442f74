"""LatentspeedMLAImpl's two hooks, called the way vLLM's MLAAttention calls them, on the CPU.

The cache is the raw buffer vLLM allocates for the kv-cache dtype (uint8 for every fp8
flavour), and for decode it is handed over viewed as E4M3, as ``MLAAttention.forward_impl``
does for any fp8 cache; the impl must write and read what the dtype says. Kernels run in
Triton's interpreter; results are checked against the PyTorch reference.
"""

import pytest
import torch
from vllm.config import VllmConfig, set_current_vllm_config

from common_kernels.mla import plan_decode
from common_kernels.mla.reference import mla_decode_ref
from tests.helpers import BATCH_SPECS, assert_close
from vllm_plugin.mla import LatentspeedDecodeMetadata, LatentspeedMLAImpl, LatentspeedMLAMetadata

D_LATENT, D_ROPE, PAGE, HEADS = 512, 64, 16, 16
RAW_CACHE = {"auto": torch.bfloat16, "fp8_e4m3": torch.uint8, "fp8_e5m2": torch.uint8}
TYPED = {"auto": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
# (atol, rtol) of a stored value against its exact x / scale: half an ulp, subnormals included.
STORE_TOL = {"auto": (0.0, 0.0), "fp8_e4m3": (2**-10, 2**-4), "fp8_e5m2": (2**-17, 2**-3)}


class Layer:
    """The attributes of vLLM's MLAAttention layer that forward_mqa reads."""

    def __init__(self, k_scale: float):
        self._k_scale = torch.tensor(k_scale)


def make_impl(kv_cache_dtype: str) -> LatentspeedMLAImpl:
    torch.set_default_dtype(torch.bfloat16)  # vLLM builds layers under the model dtype
    try:
        with set_current_vllm_config(VllmConfig()):
            return LatentspeedMLAImpl(
                num_heads=HEADS, head_size=D_LATENT + D_ROPE, scale=192**-0.5, num_kv_heads=1, alibi_slopes=None,
                sliding_window=None, kv_cache_dtype=kv_cache_dtype, logits_soft_cap=None, attn_type="decoder",
                kv_sharing_target_layer_name=None, q_lora_rank=None, kv_lora_rank=D_LATENT, qk_nope_head_dim=128,
                qk_rope_head_dim=D_ROPE, qk_head_dim=192, v_head_dim=128, kv_b_proj=None,
            )
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.mark.parametrize("kv_cache_dtype", RAW_CACHE.keys())
@pytest.mark.parametrize("spec", [BATCH_SPECS["ragged_with_empty"], BATCH_SPECS["spec_decode_2"]], ids=lambda s: s.name)
def test_cache_update_then_decode(hopper, kv_cache_dtype, spec):
    impl = make_impl(kv_cache_dtype)
    assert impl.supports_quant_query_input is False  # queries stay bf16 for every cache dtype
    layer = Layer(k_scale=0.25 if kv_cache_dtype != "auto" else 1.0)
    batch, q_len = len(spec.seq_lens), spec.q_len
    pages = [-(-n // PAGE) for n in spec.seq_lens]
    raw = torch.zeros(sum(pages) + 1, PAGE, D_LATENT + D_ROPE, dtype=RAW_CACHE[kv_cache_dtype])
    table = torch.full((batch, max(pages) + 1), 10_000, dtype=torch.int32)
    slots, first_page = [], 0
    for b, (n, p) in enumerate(zip(spec.seq_lens, pages)):
        table[b, :p] = torch.arange(first_page, first_page + p, dtype=torch.int32)
        slots += [(first_page + pos // PAGE) * PAGE + pos % PAGE for pos in range(n)]
        first_page += p
    slot_mapping = torch.tensor(slots + [-1, -1], dtype=torch.long)  # two padding tokens
    kv_c_and_pe = torch.randn(len(slot_mapping), D_LATENT + D_ROPE, dtype=torch.bfloat16)
    kv_c, k_pe = kv_c_and_pe[:, :D_LATENT], kv_c_and_pe[:, D_LATENT:].unsqueeze(1)  # strided, as vLLM's split

    impl.do_kv_cache_update(kv_c, k_pe, raw, slot_mapping, kv_cache_dtype, layer._k_scale)

    typed = raw.view(TYPED[kv_cache_dtype])
    stored = typed.view(-1, D_LATENT + D_ROPE)[torch.tensor(slots, dtype=torch.long)].float()
    expected = kv_c_and_pe[: len(slots)].float() / float(layer._k_scale)
    atol, rtol = STORE_TOL[kv_cache_dtype]
    assert_close(stored, expected, atol=atol, rtol=rtol, name="cache")

    q_nope = torch.randn(HEADS, batch * q_len, D_LATENT, dtype=torch.bfloat16).transpose(0, 1)  # vLLM's bmm output view
    q_pe = torch.randn(batch * q_len, HEADS, D_ROPE, dtype=torch.bfloat16)
    seq_lens = torch.tensor(spec.seq_lens, dtype=torch.int32)
    plan = plan_decode(batch, HEADS, q_len, max(spec.seq_lens), num_sms=2, num_splits=2)
    decode = LatentspeedDecodeMetadata(block_table=table, seq_lens=seq_lens, dcp_tot_seq_lens=None, plan=plan)
    metadata = LatentspeedMLAMetadata(
        num_reqs=batch, max_query_len=q_len, max_seq_len=max(spec.seq_lens), num_actual_tokens=batch * q_len,
        query_start_loc=torch.arange(0, batch * q_len + 1, q_len, dtype=torch.int32), slot_mapping=slot_mapping,
        num_decodes=batch, num_decode_tokens=batch * q_len, num_prefills=0, decode=decode,
    )
    handed_over = raw.view(torch.float8_e4m3fn) if kv_cache_dtype != "auto" else raw

    out, lse = impl.forward_mqa((q_nope, q_pe), handed_over, metadata, layer)

    ref, ref_lse = mla_decode_ref(q_nope, q_pe, typed, table, seq_lens, impl.scale, layer._k_scale,
                                  fp8_queries=plan.fp8_queries(typed.dtype))
    assert_close(out, ref, atol=2e-2, rtol=2e-2, name="decode out")
    assert_close(lse, ref_lse, atol=2e-3, rtol=2e-3, name="decode lse")


def test_impl_refuses_unsupported_layers(hopper):
    torch.set_default_dtype(torch.bfloat16)
    try:
        with set_current_vllm_config(VllmConfig()), pytest.raises(ValueError, match="kv_lora_rank=320"):
            LatentspeedMLAImpl(
                num_heads=HEADS, head_size=384, scale=1.0, num_kv_heads=1, alibi_slopes=None, sliding_window=None,
                kv_cache_dtype="auto", logits_soft_cap=None, attn_type="decoder", kv_sharing_target_layer_name=None,
                q_lora_rank=None, kv_lora_rank=320, qk_nope_head_dim=128, qk_rope_head_dim=D_ROPE, qk_head_dim=192,
                v_head_dim=128, kv_b_proj=None,
            )
    finally:
        torch.set_default_dtype(torch.float32)
