"""Write a small DeepSeek-V3 checkpoint with random weights at the usual init scale.

The attention is DeepSeek-V3's own (128 heads, kv_lora_rank 512, rope 64, nope 128, v 128);
the rest is shrunk (3 layers: one dense, two MoE with one shared expert). ``--widths tiny``
(default): hidden 1024, q_lora_rank 384, 8 routed experts of 256, top 2, a dense MLP of 2048,
about 0.2 GB. ``--widths deepseek-v3``: every width of DeepSeek-V3 (hidden 7168, q_lora_rank
1536, experts of 2048, a dense MLP of 18432), 16 routed experts, top 8, about 5 GB: its layers
run the GEMMs, norms and activations at the shapes of the real model. Weights are drawn by
transformers' initializer (normal, std 0.02) and saved as safetensors, so log-probabilities
differ between tokens and a numerics comparison means something -- unlike vLLM's
``load_format="dummy"``, whose U(-1e-3, 1e-3) weights make every log-probability equal
``-log(vocab)``.

    python examples/tiny_deepseek_v3.py /tmp/tiny-dsv3 [--widths deepseek-v3]
"""

import argparse
import json
from pathlib import Path

import torch


WIDTHS = {
    "tiny": dict(hidden_size=1024, intermediate_size=2048, moe_intermediate_size=256, n_routed_experts=8,
                 num_experts_per_tok=2, q_lora_rank=384),
    "deepseek-v3": dict(hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, n_routed_experts=16,
                        num_experts_per_tok=8, q_lora_rank=1536),
}


def make_tiny_deepseek_v3(path: str, num_heads: int = 128, num_layers: int = 3, seed: int = 0,
                          widths: str = "tiny") -> str:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(
        vocab_size=4096,
        **WIDTHS[widths],
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = DeepseekV3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    config_path = Path(path) / "config.json"
    saved = json.loads(config_path.read_text())
    # SGLang's DeepSeek loader reads moe_layer_freq, which save_pretrained leaves out.
    saved.setdefault("moe_layer_freq", 1)
    # vLLM creates the router bias only for V3's routing, which newer transformers do not name.
    saved.setdefault("topk_method", "noaux_tc")
    saved.setdefault("scoring_func", "sigmoid")
    saved["torch_dtype"] = "bfloat16"
    config_path.write_text(json.dumps(saved, indent=2))
    return path


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--heads", type=int, default=128)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--widths", choices=sorted(WIDTHS), default="tiny")
    args = parser.parse_args()
    print(make_tiny_deepseek_v3(args.out, args.heads, args.layers, widths=args.widths))
