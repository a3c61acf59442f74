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


@pytest.mark.parametrize("checkpoint", CHECKPOINTS, ids=lambda p: p.name)
def test_every_sglang_layer_finds_its_scheme(checkpoint):
    model, recipe = checkpoint.name.split("-", 1)
    config = CompressedTensorsConfig.from_config(json.loads((checkpoint / "config.json").read_text())["quantization_config"])
    layer = torch.nn.Module()  # matched by name: no target names a module class
    for name in SGLANG_LINEARS[model]:
        scheme = config.get_scheme_dict(layer, name)
        kept = any(part in name and recipe in recipes for part, recipes in KEPT_BF16.items())
        assert (scheme is None) == kept, f"{name}: {'a scheme' if scheme else 'no scheme'} under {recipe}"
    # SGLang looks a FusedMoE layer's scheme up under its first expert's unfused names.
    for proj in ("gate_proj", "up_proj", "down_proj"):
        assert config.get_scheme_dict(layer, f"model.layers.1.mlp.experts.0.{proj}") is not None, proj
