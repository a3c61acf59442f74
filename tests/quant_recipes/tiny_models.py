"""Tiny random DeepSeek-V3 and Qwen3-MoE checkpoints (bf16 safetensors, a byte-level BPE
tokenizer trained on the default calibration text), built in seconds on the CPU."""

import json
from pathlib import Path

import torch

from quant_recipes import DEFAULT_CALIBRATION


def _tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = [json.loads(line)["text"] for line in DEFAULT_CALIBRATION.read_text().splitlines()]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<eos>"],
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def tiny_deepseek_v3(path: Path) -> Path:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(
        vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=256, num_hidden_layers=2,
        first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
        n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1, q_lora_rank=256, kv_lora_rank=128,
        qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, max_position_embeddings=512,
        num_nextn_predict_layers=0, tie_word_embeddings=False,
    )
    return _save(DeepseekV3ForCausalLM, config, path)


def tiny_qwen3_moe(path: Path) -> Path:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=512, tie_word_embeddings=False,
    )
    return _save(Qwen3MoeForCausalLM, config, path)


def _save(model_class, config, path: Path) -> Path:
    torch.manual_seed(0)
    model_class(config).to(torch.bfloat16).save_pretrained(path)
    _tokenizer(config.vocab_size).save_pretrained(path)
    return path
