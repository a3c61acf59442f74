"""Which keys of a chunked prefill an fp8 latent cache rounds, and what each choice costs: the
reference model in transformers (fp32, CPU), its MLA latent (normalized ``kv`` and rotated
``k_pe``) rounded to E4M3 with a unit scale (as SGLang stores it) for the (query, key) pairs a
policy names, perplexity over the held-out windows the engine tables use.

    python -m benchmarks.reference_model.fp8_cache_exposure --model /tmp/refmodel

Policies, for ``--chunk``-token prefill chunks:
- ``none``: every key fresh (the bf16 engines);
- ``prior-chunks``: a chunk reads the earlier chunks from the cache and its own keys fresh
  (SGLang's triton extend, vLLM's chunked-context prefill);
- ``own-chunk-too``: the first chunk fresh, later chunks read every key, their own included,
  from the cache (an absorbed extend over a cache already holding the chunk);
- ``all``: every key from the cache (decode-like).
"""

import argparse
import math
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM
from transformers.models.deepseek_v3 import modeling_deepseek_v3

from latentspeed.evaluate import load_windows

POLICIES = ("none", "prior-chunks", "own-chunk-too", "all")


def rounded_pairs(length: int, chunk: int, policy: str) -> torch.Tensor:
    """``[length, length]`` bool: key ``k`` is read from the fp8 cache by query ``q``."""
    chunk_q = (torch.arange(length) // chunk)[:, None].expand(length, length)
    chunk_k = (torch.arange(length) // chunk)[None, :].expand(length, length)
    if policy == "none":
        return torch.zeros(length, length, dtype=torch.bool)
    if policy == "prior-chunks":
        return chunk_k < chunk_q
    if policy == "own-chunk-too":
        return chunk_q >= 1
    if policy == "all":
        return torch.ones(length, length, dtype=torch.bool)
    raise ValueError(f"unknown policy {policy!r}: one of {POLICIES}")


def _to_e4m3(t: torch.Tensor) -> torch.Tensor:
    return t.clamp(-448, 448).to(torch.float8_e4m3fn).to(t.dtype)


def attention_with_fp8_cache(attn, hidden_states, position_embeddings, rounded: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3's MLA (transformers' module ``attn``, no KV cache, causal) with the latent of
    the ``rounded`` (query, key) pairs taken through E4M3."""
    batch, length = hidden_states.shape[:-1]
    q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(hidden_states)))
    q = q.view(batch, length, -1, attn.qk_head_dim).transpose(1, 2)
    q_pass, q_rot = torch.split(q, [attn.qk_nope_head_dim, attn.qk_rope_head_dim], dim=-1)
    kv, k_rot = torch.split(attn.kv_a_proj_with_mqa(hidden_states), [attn.kv_lora_rank, attn.qk_rope_head_dim], dim=-1)
    kv = attn.kv_a_layernorm(kv).view(batch, 1, length, attn.kv_lora_rank)
    k_rot = k_rot.view(batch, 1, length, attn.qk_rope_head_dim)
    cos, sin = position_embeddings
    rope = (modeling_deepseek_v3.apply_rotary_pos_emb_interleave if attn.config.rope_interleave
            else modeling_deepseek_v3.apply_rotary_pos_emb)
    q_rot, k_rot = rope(q_rot, k_rot, cos, sin)
    query = torch.cat((q_pass, q_rot), dim=-1)
    k_fresh, v_fresh = attn.expand_kv(kv, k_rot)
    k_cached, v_cached = attn.expand_kv(_to_e4m3(kv), _to_e4m3(k_rot))
    scores = torch.where(rounded, query @ k_cached.transpose(-1, -2), query @ k_fresh.transpose(-1, -2))
    future = torch.ones(length, length, dtype=torch.bool).triu(1)
    probs = (scores * attn.scaling).masked_fill(future, float("-inf")).softmax(-1)
    out = (probs * rounded) @ v_cached + (probs * ~rounded) @ v_fresh
    return attn.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


def window_logprobs(model, windows, chunk: int, policy: str) -> torch.Tensor:
    """Next-token log-probs of every window, every attention layer under ``policy``."""
    original = modeling_deepseek_v3.DeepseekV3Attention.forward

    def forward(attn, hidden_states, position_embeddings, attention_mask, cache=None, **kwargs):
        rounded = rounded_pairs(hidden_states.shape[1], chunk, policy)
        return attention_with_fp8_cache(attn, hidden_states, position_embeddings, rounded), None

    modeling_deepseek_v3.DeepseekV3Attention.forward = forward
    try:
        out = []
        with torch.no_grad():
            for window in windows:
                ids = torch.tensor([window])
                logp = model(input_ids=ids).logits.float().log_softmax(-1)[0, :-1]
                out.append(logp.gather(1, ids[0, 1:, None])[:, 0])
        return torch.cat(out)
    finally:
        modeling_deepseek_v3.DeepseekV3Attention.forward = original


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--text", default=None, help="default: heldout.txt in --model")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--max-windows", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=128, help="the engines' prefill chunk (engine_eval's default)")
    args = parser.parse_args(argv)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    windows = load_windows(args.model, args.text or str(Path(args.model, "heldout.txt")), args.window, args.max_windows)
    base = None
    print("| policy | perplexity | vs none | mean abs Δ log-prob vs none |\n|---|---|---|---|")
    for policy in POLICIES:
        logp = window_logprobs(model, windows, args.chunk, policy)
        ppl = math.exp(-logp.mean().item())
        base = base or (ppl, logp)
        print(f"| {policy} | {ppl:.4f} | {100 * (ppl / base[0] - 1):+.3f} % | {(logp - base[1]).abs().mean():.4f} |",
              flush=True)


if __name__ == "__main__":
    main()
