"""Tiny DeepSeek-V3 checkpoints in the three formats ``latentspeed_fp8`` loads, written as the
tests' own safetensors files under Hugging Face's tensor names, so each engine's real model loader
reads them:

- ``deepseek_fp8``: DeepSeek-V3's own FP8 (E4M3 weights, fp32 ``weight_scale_inv`` per 128 x 128
  block, ``quantization_config`` with ``quant_method: fp8``);
- ``compressed_tensors``: what llm-compressor writes for an FP8 block recipe (``weight_scale``);
- ``bf16``: no quantization config.

Every projection of attention and of the MLPs (dense, shared and routed experts) is quantized;
embeddings, norms, the router and ``lm_head`` stay bf16, as in DeepSeek-V3's own checkpoint.
"""

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from common_kernels.fp8.reference import quantize_weight_blocks_ref

CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 256,
    "intermediate_size": 512, "moe_intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 16,
    "num_key_value_heads": 16, "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
    "n_group": 1, "topk_group": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid", "first_k_dense_replace": 1,
    "moe_layer_freq": 1, "q_lora_rank": 128, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "vocab_size": 1024, "max_position_embeddings": 4096, "torch_dtype": "bfloat16",
}
DEEPSEEK_FP8 = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic", "fmt": "e4m3"}
COMPRESSED_TENSORS_FP8_BLOCK = {
    "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "block",
                    "block_structure": [128, 128], "dynamic": False},
        "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "group",
                              "group_size": 128, "dynamic": True}}},
    "ignore": ["lm_head", "re:.*mlp\\.gate$"],
}
FORMATS = {"deepseek_fp8": ("weight_scale_inv", DEEPSEEK_FP8),
           "compressed_tensors": ("weight_scale", COMPRESSED_TENSORS_FP8_BLOCK),
           "bf16": (None, None)}


def bf16_tensors(config: dict = CONFIG) -> dict[str, torch.Tensor]:
    """Random weights at init scale (std 0.02, norms 1) under DeepSeek-V3's Hugging Face names."""
    c = config
    hidden, heads, nope, rope, v = (c["hidden_size"], c["num_attention_heads"], c["qk_nope_head_dim"],
                                    c["qk_rope_head_dim"], c["v_head_dim"])

    def init(*shape):
        return torch.randn(*shape) * 0.02

    t = {"model.embed_tokens.weight": init(c["vocab_size"], hidden), "model.norm.weight": torch.ones(hidden),
         "lm_head.weight": init(c["vocab_size"], hidden)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t |= {p + "input_layernorm.weight": torch.ones(hidden), p + "post_attention_layernorm.weight": torch.ones(hidden),
              p + "self_attn.q_a_proj.weight": init(c["q_lora_rank"], hidden),
              p + "self_attn.q_a_layernorm.weight": torch.ones(c["q_lora_rank"]),
              p + "self_attn.q_b_proj.weight": init(heads * (nope + rope), c["q_lora_rank"]),
              p + "self_attn.kv_a_proj_with_mqa.weight": init(c["kv_lora_rank"] + rope, hidden),
              p + "self_attn.kv_a_layernorm.weight": torch.ones(c["kv_lora_rank"]),
              p + "self_attn.kv_b_proj.weight": init(heads * (nope + v), c["kv_lora_rank"]),
              p + "self_attn.o_proj.weight": init(hidden, heads * v)}
        if i < c["first_k_dense_replace"]:
            mlps, inter = ["mlp"], c["intermediate_size"]
        else:
            mlps, inter = [f"mlp.experts.{e}" for e in range(c["n_routed_experts"])] + ["mlp.shared_experts"], \
                c["moe_intermediate_size"]
            t |= {p + "mlp.gate.weight": init(c["n_routed_experts"], hidden),
                  p + "mlp.gate.e_score_correction_bias": torch.zeros(c["n_routed_experts"])}
        for mlp in mlps:
            t |= {p + f"{mlp}.gate_proj.weight": init(inter, hidden), p + f"{mlp}.up_proj.weight": init(inter, hidden),
                  p + f"{mlp}.down_proj.weight": init(hidden, inter)}
    return {k: w.to(torch.bfloat16) for k, w in t.items()}


def is_quantized(name: str) -> bool:
    return name.endswith("_proj.weight") or name.endswith("_proj_with_mqa.weight")


def write_checkpoint(path: Path, fmt: str, tensors: dict[str, torch.Tensor] | None = None,
                     config: dict = CONFIG) -> dict[str, torch.Tensor]:
    """Write ``config.json`` and ``model.safetensors`` in ``fmt`` (a key of ``FORMATS``) to ``path``;
    returns what was written (for the FP8 formats, quantized by the reference quantizer)."""
    scale_name, quant_config = FORMATS[fmt]
    written = {}
    for name, weight in (tensors or bf16_tensors(config)).items():
        if scale_name is not None and is_quantized(name) and weight.dtype == torch.bfloat16:
            written[name], written[f"{name[:-len('weight')]}{scale_name}"] = quantize_weight_blocks_ref(weight.float())
        else:
            written[name] = weight
    path.mkdir(parents=True, exist_ok=True)
    save_file(written, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(dict(config, **({"quantization_config": quant_config}
                                                                  if quant_config else {}))))
    return written


def dequantized(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """A block-FP8 weight ``[N, K]`` times its ``[cdiv(N, 128), cdiv(K, 128)]`` scales, in fp32."""
    n, k = weight.shape
    return weight.float() * scale.float().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]


def placements(fused_qkv_a: str, experts: str, config: dict = CONFIG):
    """Where an engine's DeepSeek-V3 puts each checkpoint projection: ``(Hugging Face name, module,
    expert or None, row offset)``. Engines differ in two names: the fused ``q_a``/``kv_a``
    projection and the routed experts' module (``fused_qkv_a`` and ``experts``, under a layer)."""
    q_lora, inter, moe_inter = config["q_lora_rank"], config["intermediate_size"], config["moe_intermediate_size"]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        yield p + "self_attn.q_a_proj", p + fused_qkv_a, None, 0
        yield p + "self_attn.kv_a_proj_with_mqa", p + fused_qkv_a, None, q_lora
        for proj in ("q_b_proj", "kv_b_proj", "o_proj"):
            yield p + f"self_attn.{proj}", p + f"self_attn.{proj}", None, 0
        dense = i < config["first_k_dense_replace"]
        for mlp, width in [("mlp", inter)] if dense else [("mlp.shared_experts", moe_inter)]:
            yield p + f"{mlp}.gate_proj", p + f"{mlp}.gate_up_proj", None, 0
            yield p + f"{mlp}.up_proj", p + f"{mlp}.gate_up_proj", None, width
            yield p + f"{mlp}.down_proj", p + f"{mlp}.down_proj", None, 0
        if not dense:
            for e in range(config["n_routed_experts"]):
                yield p + f"mlp.experts.{e}.gate_proj", p + experts + ".w13", e, 0
                yield p + f"mlp.experts.{e}.up_proj", p + experts + ".w13", e, moe_inter
                yield p + f"mlp.experts.{e}.down_proj", p + experts + ".w2", e, 0


def loaded_block(params: dict, target: str, expert: int | None, offset: int, rows: int, scale_name: str):
    """The rows ``[offset, offset + rows)`` of a loaded weight (of one expert) and their block scales."""
    weight, scale = params[f"{target}_weight" if expert is not None else f"{target}.weight"], \
        params[f"{target}_{scale_name}" if expert is not None else f"{target}.{scale_name}"]
    if expert is not None:
        weight, scale = weight[expert], scale[expert]
    return weight[offset:offset + rows], scale[offset // 128:-(-(offset + rows) // 128)]


def assert_loaded_as_written(params: dict, written: dict, original: dict, fmt: str, scale_name: str, fused_qkv_a: str,
                             experts: str) -> None:
    """Every checkpoint projection where the engine put it (``placements``' names): bit for bit for
    the FP8 formats, within fp8 rounding of the original for bf16 (quantized while loading)."""
    from tests.helpers import assert_close

    for source, target, expert, offset in placements(fused_qkv_a, experts):
        checkpoint = written[f"{source}.weight"]
        weight, scale = loaded_block(params, target, expert, offset, checkpoint.shape[0], scale_name)
        if fmt == "bf16":
            assert_close(dequantized(weight, scale), original[f"{source}.weight"], atol=2e-3, rtol=7e-2, name=source)
        else:
            assert torch.equal(weight.view(torch.uint8), checkpoint.view(torch.uint8)), source
            assert torch.equal(scale, written[f"{source}.{scale_name}"]), source


# Flaws of an FP8 checkpoint, and what latentspeed_fp8's refusal says in either engine.
FLAWS = {
    "bf16_expert": r"latentspeed_fp8: model\.layers\.1\.mlp\.experts.* w13 weight: the checkpoint stores "
                   r"torch\.bfloat16",
    "missing_scale": r"latentspeed_fp8: model\.layers\.0\.self_attn\.o_proj: the checkpoint has no scale for some "
                     r"weight blocks",
}


def write_bad_checkpoint(path: Path, fmt: str, flaw: str, config: dict = CONFIG) -> None:
    """An FP8 checkpoint with one of ``FLAWS``: ``bf16_expert`` (layer 1's expert 2 ``up_proj`` left
    in bf16) or ``missing_scale`` (no scale for layer 0's ``o_proj``)."""
    written = write_checkpoint(path, fmt, config=config)
    if flaw == "bf16_expert":
        name = "model.layers.1.mlp.experts.2.up_proj.weight"
        written[name] = written[name].to(torch.bfloat16)
    elif flaw == "missing_scale":
        del written[f"model.layers.0.self_attn.o_proj.{FORMATS[fmt][0]}"]
    else:
        raise ValueError(f"unknown flaw {flaw!r}")
    save_file(written, str(path / "model.safetensors"))


def assert_unquantized_kept(params: dict, written: dict) -> None:
    """The tensors no FP8 format quantizes (embeddings, norms, ``lm_head``, the router and its bias)
    loaded as written."""
    kept = [name for name in written if not is_quantized(name) and not name.endswith("scale_inv")]
    assert len(kept) == 13
    for name in kept:
        assert torch.equal(params[name].float(), written[name].float()), name
