"""latentspeed's MLA prefill backend as vLLM 0.26.0 builds and calls it, on the CPU: vLLM's selector picks the
class, vLLM's prefill metadata is handed over, and both calls (new tokens, a chunk of cached context) match the
reference. The kernel runs in Triton's interpreter."""

import pytest
import torch
from vllm.model_executor.layers.attention.mla_attention import MLACommonPrefillMetadata
from vllm.v1.attention.backends.mla.prefill import get_mla_prefill_backend

import vllm_plugin
from common_kernels.mla.reference import varlen_attention_ref
from tests.helpers import assert_close
from tests.vllm_plugin.test_wiring import engine_config

HEADS, SCALE = 4, 192**-0.5


def cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def randn(tokens, dim):
    return torch.randn(tokens, HEADS, dim, dtype=torch.bfloat16)


@pytest.fixture
def backend(hopper, tmp_path):
    vllm_plugin.register()
    config = engine_config(tmp_path, prefill="CUSTOM")
    return get_mla_prefill_backend(config)(num_heads=HEADS, scale=SCALE, kv_lora_rank=512, qk_nope_head_dim=128,
                                           qk_rope_head_dim=64, v_head_dim=128, vllm_config=config)


def metadata(q_lens, context_lens):
    chunk = MLACommonPrefillMetadata.ChunkedContextMetadata(
        cu_seq_lens=cu(context_lens)[None], starts=torch.zeros(1, len(q_lens), dtype=torch.int32),
        seq_tot=[sum(context_lens)], max_seq_lens=[max(context_lens)], seq_lens=torch.tensor([context_lens]),
        workspace=torch.empty(0), token_to_seq=torch.empty(0), chunk_total_token=[sum(context_lens)],
        has_empty_context=[min(context_lens) == 0],
    )
    return MLACommonPrefillMetadata(block_table=torch.empty(0), query_start_loc=cu(q_lens), max_query_len=max(q_lens),
                                    chunked_context=chunk)


@pytest.mark.parametrize("return_lse", [False, True], ids=["no_lse", "lse"])
def test_new_tokens_attend_causally_to_themselves(backend, return_lse):
    q_lens = [9, 1, 20]
    backend.prepare_metadata(metadata(q_lens, [5, 0, 17]))
    q, k, kv = randn(sum(q_lens), 192), randn(sum(q_lens), 192), randn(sum(q_lens), 256)
    out = torch.full((sum(q_lens), HEADS, 128), float("nan"), dtype=torch.bfloat16)
    result = backend.run_prefill_new_tokens(q, k, kv[..., 128:], return_softmax_lse=return_lse, out=out)
    ref, ref_lse = varlen_attention_ref(q, k, kv[..., 128:], cu(q_lens), cu(q_lens), SCALE, causal=True)
    if return_lse:
        result, lse = result
        assert_close(lse, ref_lse, atol=2e-3, rtol=2e-3, name="lse")
    assert result.data_ptr() == out.data_ptr()
    assert_close(result, ref, atol=1e-2, rtol=2e-2, name="out")


def test_a_context_chunk_is_attended_without_a_mask(backend):
    q_lens, context_lens = [9, 1, 20], [5, 0, 17]
    backend.prepare_metadata(metadata(q_lens, context_lens))
    q, k, v = randn(sum(q_lens), 192), randn(sum(context_lens), 192), randn(sum(context_lens), 128)
    out, lse = backend.run_prefill_context_chunk(0, q, k, v)
    ref, ref_lse = varlen_attention_ref(q, k, v, cu(q_lens), cu(context_lens), SCALE, causal=False)
    assert_close(out, ref, atol=1e-2, rtol=2e-2, name="out")
    assert_close(lse, ref_lse, atol=2e-3, rtol=2e-3, name="lse")
    assert torch.isneginf(lse[:, 9]).all()  # the one-token sequence has no context: -inf, merged away by vLLM


def test_quantized_output_is_refused(backend):
    backend.prepare_metadata(metadata([4], [0]))
    q = randn(4, 192)
    with pytest.raises(NotImplementedError, match="quantized outputs"):
        backend.run_prefill_new_tokens(q, q, randn(4, 128), False, output_scale=torch.ones(1))
