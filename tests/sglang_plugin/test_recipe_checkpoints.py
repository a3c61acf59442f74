"""The recipes' checkpoints under SGLang 0.5.17's compressed-tensors config: every layer SGLang
builds (under the names of its fused layers: ``fused_qkv_a_proj_with_mqa``, ``qkv_proj``,
``gate_up_proj``) finds its scheme, and the layers a recipe keeps in bf16 find none. (Whether
SGLang has kernels for a scheme on a given GPU is another matter: on the H200 it has none for the
FP4 recipes' W4A4 layers.)

``.ci/test`` runs tests/quant_recipes first with ``LATENTSPEED_QUANT_CHECKPOINTS`` set; these tests
read what it left there (and are skipped when the variable is unset, outside CI).
"""

import json
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("sglang")

from sglang.srt.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig  # noqa: E402

ROOT = os.environ.get("LATENTSPEED_QUANT_CHECKPOINTS")
pytestmark = pytest.mark.skipif(not ROOT, reason="LATENTSPEED_QUANT_CHECKPOINTS is not set (.ci/test sets it)")
CHECKPOINTS = sorted(p for p in Path(ROOT).iterdir() if (p / "latentspeed_report.json").exists()) if ROOT else []

# The linear layers of SGLang's models, by the names it builds them under (layer 0 dense, 1 MoE).
SGLANG_LINEARS = {
    "deepseek_v3": ["model.layers.0.self_attn.fused_qkv_a_proj_with_mqa", "model.layers.0.self_attn.q_b_proj",
                    "model.layers.0.self_attn.kv_b_proj", "model.layers.0.self_attn.o_proj",
                    "model.layers.0.mlp.gate_up_proj", "model.layers.0.mlp.down_proj",
                    "model.layers.1.mlp.shared_experts.gate_up_proj", "model.layers.1.mlp.shared_experts.down_proj"],
    "qwen3_moe": ["model.layers.0.self_attn.qkv_proj", "model.layers.0.self_attn.o_proj"],
}
KEPT_BF16 = {"kv_b_proj": ("nvfp4", "nvfp4a16", "mxfp4")}  # FP4 recipes keep DeepSeek's kv_b_proj in bf16


def sglang_layer(name: str) -> torch.nn.Module:
    """A stand-in with the class name SGLang builds the layer under (targets may name a class)."""
    leaf = name.rpartition(".")[2]
    cls = {"fused_qkv_a_proj_with_mqa": "ReplicatedLinear", "gate_up_proj": "MergedColumnParallelLinear",
           "qkv_proj": "QKVParallelLinear", "o_proj": "RowParallelLinear", "down_proj": "RowParallelLinear",
           "experts": "FusedMoE"}.get(leaf, "ColumnParallelLinear")
    return type(cls, (torch.nn.Module,), {})()


@pytest.mark.parametrize("checkpoint", CHECKPOINTS, ids=lambda p: p.name)
def test_every_sglang_layer_finds_its_scheme(checkpoint):
    model, recipe = checkpoint.name.split("-", 1)
    config = CompressedTensorsConfig.from_config(json.loads((checkpoint / "config.json").read_text())["quantization_config"])
    for name in SGLANG_LINEARS[model]:
        scheme = config.get_scheme_dict(sglang_layer(name), name)
        kept = any(part in name and recipe in recipes for part, recipes in KEPT_BF16.items())
        assert (scheme is None) == kept, f"{name}: {'a scheme' if scheme else 'no scheme'} under {recipe}"
    # SGLang looks a FusedMoE layer's scheme up under its first expert's unfused names.
    config._add_fused_moe_to_target_scheme_map()
    for proj in ("gate_proj", "up_proj", "down_proj"):
        name = f"model.layers.1.mlp.experts.0.{proj}"
        assert config.get_scheme_dict(sglang_layer("model.layers.1.mlp.experts"), name) is not None, proj
    if recipe.startswith("fp8-block"):
        # SGLang places a fused layer's block scales with this; None failed on the H200 (refmodel-eval-2026-12-01).
        assert config.weight_block_size == [128, 128]


FP8_BLOCK = [p for p in CHECKPOINTS if json.loads((p / "latentspeed_report.json").read_text())["recipe"] == "fp8-block"]


@pytest.mark.parametrize("checkpoint", FP8_BLOCK, ids=lambda p: p.name)
def test_fp8_block_checkpoint_experts_run_on_latentspeeds_fused_moe(checkpoint, tmp_path):
    """Layer 1's routed experts, as llm-compressor wrote them, through SGLang's MoE weight loader
    into latentspeed's fused MoE under ``--quantization latentspeed_fp8``."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang_plugin.fp8 import LatentspeedCTW8A8Fp8MoE, LatentspeedFp8Config
    from tests.checkpoint_experts import PREFIX, assert_experts_match_reference, load_experts, moe_shape
    from tests.sglang_plugin.test_fp8_moe_method import apply, publish_tiny_deepseek, single_rank

    publish_tiny_deepseek(tmp_path)
    model, experts, top_k = moe_shape(checkpoint)
    with single_rank():
        layer = FusedMoE(num_experts=experts, hidden_size=model["hidden_size"],
                         intermediate_size=model["moe_intermediate_size"], layer_id=1, top_k=top_k,
                         params_dtype=torch.bfloat16, quant_config=LatentspeedFp8Config.from_config(
                             model["quantization_config"]), prefix=PREFIX)
    assert type(layer.scheme) is LatentspeedCTW8A8Fp8MoE
    stored = load_experts(checkpoint, experts, lambda name, value, shard, e: layer.weight_loader(
        getattr(layer, name), value, name, shard, e))
    layer.quant_method.process_weights_after_loading(layer)
    assert_experts_match_reference(lambda x, weights, ids: apply(layer, x, weights, ids), stored,
                                   model["hidden_size"], experts, top_k)


MIXED = [p for p in CHECKPOINTS if json.loads((p / "latentspeed_report.json").read_text())["recipe"] == "mixed"]


@pytest.mark.parametrize("checkpoint", MIXED, ids=lambda p: p.name)
def test_mixed_checkpoint_leaves_its_fp4_experts_to_sglangs_scheme(checkpoint):
    from sglang_plugin.fp8 import LatentspeedCTConfig, LatentspeedFp8Config

    config = LatentspeedFp8Config.from_config(json.loads((checkpoint / "config.json").read_text())["quantization_config"])
    assert type(config) is LatentspeedCTConfig
    # SGLang's own NVFP4 experts scheme, which refuses GPUs before Blackwell (this machine has none).
    with pytest.raises(ValueError, match="does not support NVFP4 quantization"):
        config.get_moe_scheme(sglang_layer("model.layers.1.mlp.experts"), "model.layers.1.mlp.experts")
