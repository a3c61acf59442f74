"""The reference model's DeepSeek-V3 configuration, sized to a byte budget.

DeepSeek-V3's attention shape where it matters to the kernels and to the engines (head dims
nope 128, rope 64, v 128, since stock vLLM's MLA prefill on Hopper, FlashAttention, takes only
DeepSeek's and two other models' dims; 8 heads to stay in budget; the largest latent rank that
fits), MoE with 8 routed experts (top 2) and one shared
expert, sigmoid scores with aux-loss-free (``noaux_tc``) routing, first layer dense. Written so
that transformers, vLLM and SGLang all load it without remote code (``moe_layer_freq``,
``topk_method`` and ``scoring_func`` spelled out: vLLM and SGLang read them, transformers does
not write them).
"""

import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

BUDGET_BYTES = 32 << 20  # bf16 weights, so the checkpoint fits one call's carry
LATENT_RANKS = (512, 256, 128, 64)


def deepseek_v3_config(vocab_size: int, kv_lora_rank: int, max_positions: int = 4096, **overrides) -> DeepseekV3Config:
    fields = dict(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=768,
        moe_intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
        n_shared_experts=1,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        norm_topk_prob=True,
        routed_scaling_factor=1.0,
        q_lora_rank=128,
        kv_lora_rank=kv_lora_rank,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    fields.update(overrides)
    return DeepseekV3Config(**fields)


def parameter_count(config: DeepseekV3Config) -> int:
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(config)
    return sum(p.numel() for p in model.parameters())


def reference_config(vocab_size: int, budget_bytes: int = BUDGET_BYTES, **overrides) -> DeepseekV3Config:
    """The config with the largest latent rank whose bf16 weights fit ``budget_bytes``
    (``overrides`` may fix the rank, or any other field)."""
    ranks = (overrides.pop("kv_lora_rank"),) if "kv_lora_rank" in overrides else LATENT_RANKS
    for rank in ranks:
        config = deepseek_v3_config(vocab_size, rank, **overrides)
        if 2 * parameter_count(config) <= budget_bytes:
            return config
    raise ValueError(f"no reference config fits {budget_bytes} bytes with vocab {vocab_size}")


# What config.json needs beyond transformers' own fields for vLLM and SGLang to load it.
ENGINE_FIELDS = {"moe_layer_freq": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid", "torch_dtype": "bfloat16"}
