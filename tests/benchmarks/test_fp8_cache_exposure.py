"""The fp8-cache exposure tool's attention against transformers' own DeepSeek-V3 attention, and its
policies on known cases (a tiny random model on the CPU, fp32)."""

import torch
from transformers import DeepseekV3ForCausalLM

from benchmarks.reference_model.fp8_cache_exposure import POLICIES, rounded_pairs, window_logprobs
from benchmarks.reference_model.model_config import reference_config
from tests.benchmarks.test_reference_model import TINY


def tiny_model():
    torch.manual_seed(0)
    config = reference_config(320, **TINY)
    config._attn_implementation = "eager"
    return DeepseekV3ForCausalLM(config).eval()


def test_policies_name_the_pairs_they_say():
    six = {policy: rounded_pairs(6, 2, policy) for policy in POLICIES}
    assert not six["none"].any() and six["all"].all()
    assert six["prior-chunks"][4].tolist() == [True, True, True, True, False, False]  # chunk 2 reads chunks 0-1
    assert six["own-chunk-too"][4].all() and not six["own-chunk-too"][1].any()  # chunk 0 is fresh


def test_attention_matches_transformers_and_rounding_shows():
    model = tiny_model()
    windows = [torch.randint(0, 320, (40,)).tolist() for _ in range(2)]
    with torch.no_grad():
        own = torch.cat([model(input_ids=torch.tensor([w])).logits.float().log_softmax(-1)[0, :-1]
                         .gather(1, torch.tensor(w[1:])[:, None])[:, 0] for w in windows])
    fresh = window_logprobs(model, windows, chunk=16, policy="none")
    torch.testing.assert_close(fresh, own, atol=1e-5, rtol=1e-5)
    # One chunk covering the window has no earlier chunk: nothing is read from the cache.
    torch.testing.assert_close(window_logprobs(model, windows, chunk=64, policy="prior-chunks"), fresh)
    assert (window_logprobs(model, windows, chunk=16, policy="all") - fresh).abs().max() > 0
