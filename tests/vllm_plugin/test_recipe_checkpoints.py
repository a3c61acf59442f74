"""The checkpoints latentspeed's recipes write (llm-compressor 0.14, compressed-tensors 0.19), read in
the engine environment (vLLM 0.26 pins compressed-tensors 0.17): configs parse, every quantized
weight decodes to the weight the recipe measured, and FP8 block layers run under
``latentspeed_fp8``.

``.ci/test`` runs tests/quant_recipes first with ``LATENTSPEED_QUANT_CHECKPOINTS`` set; these tests
read what it left there (and are skipped when the variable is unset, outside CI).
"""

import json
import os
from pathlib import Path

import pytest
import torch
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.quantization import QuantizationConfig
from safetensors import safe_open

ROOT = os.environ.get("LATENTSPEED_QUANT_CHECKPOINTS")
pytestmark = pytest.mark.skipif(not ROOT, reason="LATENTSPEED_QUANT_CHECKPOINTS is not set (.ci/test sets it)")
CHECKPOINTS = sorted(p for p in Path(ROOT).iterdir() if (p / "latentspeed_report.json").exists()) if ROOT else []


def test_checkpoints_were_written():
    recipes = {json.loads((p / "latentspeed_report.json").read_text())["recipe"] for p in CHECKPOINTS}
    assert {"fp8-block", "fp8-block-kv", "nvfp4", "nvfp4a16", "mxfp4", "mixed"} <= recipes


def original_weight(checkpoint: Path, module: str) -> torch.Tensor:
    """The bf16 weight the recipe started from (the tests save each tiny model beside its outputs)."""
    model = checkpoint.name.split("-")[0]
    with safe_open(checkpoint.parent / f"{model}-original" / "model.safetensors", "pt") as f:
        if f"{module}.weight" in f.keys():
            return f.get_tensor(f"{module}.weight").float()
        layer, expert, proj = module.rsplit(".", 2)  # transformers saves fused experts: [E, 2I, H] and [E, H, I]
        experts = layer.rsplit(".", 1)[0]
        if proj == "down_proj":
            return f.get_tensor(f"{experts}.down_proj")[int(expert)].float()
        gate_up = f.get_tensor(f"{experts}.gate_up_proj")[int(expert)].float()
        half = gate_up.shape[0] // 2
        return gate_up[:half] if proj == "gate_proj" else gate_up[half:]


@pytest.mark.parametrize("checkpoint", CHECKPOINTS, ids=lambda p: p.name)
def test_weights_decode_with_compressed_tensors_0_17(checkpoint):
    raw = json.loads((checkpoint / "config.json").read_text())["quantization_config"]
    config = QuantizationConfig.model_validate(raw)
    report = json.loads((checkpoint / "latentspeed_report.json").read_text())
    by_scheme = {}
    for name, layer in report["layers"].items():
        by_scheme.setdefault(layer["scheme"], name)
    with safe_open(checkpoint / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        for module in by_scheme.values():
            scheme = next(s for s in config.config_groups.values()
                          if any(f"{module}.{p}" in keys for p in ("weight_packed", "weight")) and _targets(s, module))
            local = {k.rsplit(".", 1)[1]: f.get_tensor(k) for k in keys if k.rsplit(".", 1)[0] == module}
            decoded = BaseCompressor.get_value_from_registry(scheme.format).decompress(local, scheme)["weight"].float()
            original = original_weight(checkpoint, module)
            error = ((decoded - original).norm() / original.norm()).item()
            assert error == pytest.approx(report["layers"][module]["rel_error"], abs=2e-3), module


def _targets(scheme, module: str) -> bool:
    from compressed_tensors.utils.match import match_name

    # "Linear" is a class: it targets every layer of the report, all of which are linear.
    return any(target == "Linear" or match_name(module, target) for target in scheme.targets)


FP8_BLOCK = [p for p in CHECKPOINTS if json.loads((p / "latentspeed_report.json").read_text())["recipe"] == "fp8-block"]


@pytest.mark.parametrize("checkpoint", FP8_BLOCK, ids=lambda p: p.name)
def test_fp8_block_checkpoint_runs_under_latentspeed_fp8(tp_group, checkpoint):
    from vllm.model_executor.layers.linear import RowParallelLinear

    from common_kernels.fp8.reference import block_scaled_gemm_ref, quantize_per_token_group_ref
    from tests.helpers import assert_close
    from vllm_plugin.fp8 import LatentspeedCTConfig, LatentspeedFp8LinearMethod

    config = LatentspeedCTConfig.from_config(json.loads((checkpoint / "config.json").read_text())["quantization_config"])
    module = "model.layers.1.self_attn.o_proj"
    layer = RowParallelLinear(256, 256, bias=False, quant_config=config, prefix=module)
    assert type(layer.quant_method) is LatentspeedFp8LinearMethod
    with safe_open(checkpoint / "model.safetensors", "pt") as f:
        weight, scale = f.get_tensor(f"{module}.weight"), f.get_tensor(f"{module}.weight_scale")
    layer.weight_loader_v2(layer.weight, weight)
    layer.weight_loader_v2(layer.weight_scale, scale)
    layer.quant_method.process_weights_after_loading(layer)
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    a, a_scale = quantize_per_token_group_ref(x)
    assert_close(layer(x)[0], block_scaled_gemm_ref(a, a_scale, weight, scale.float()), atol=2e-2, rtol=1e-2,
                 name="o_proj out")


@pytest.mark.parametrize("checkpoint", FP8_BLOCK, ids=lambda p: p.name)
def test_fp8_block_checkpoint_experts_run_on_latentspeeds_fused_moe(tp_group, checkpoint):
    """Layer 1's routed experts, as llm-compressor wrote them, through vLLM's MoE weight loader
    into latentspeed's fused MoE."""
    from vllm.model_executor.layers.fused_moe.layer import FusedMoE

    from tests.checkpoint_experts import PREFIX, assert_experts_match_reference, load_experts, moe_shape
    from vllm_plugin.fp8 import LatentspeedCTConfig, LatentspeedCTFp8MoEMethod

    model, experts, top_k = moe_shape(checkpoint)
    runner = FusedMoE(num_experts=experts, top_k=top_k, hidden_size=model["hidden_size"],
                      intermediate_size=model["moe_intermediate_size"], params_dtype=torch.bfloat16,
                      quant_config=LatentspeedCTConfig.from_config(model["quantization_config"]), prefix=PREFIX,
                      renormalize=True)
    layer = runner.routed_experts
    assert type(layer.quant_method) is LatentspeedCTFp8MoEMethod
    stored = load_experts(checkpoint, experts, lambda name, value, shard, e: getattr(layer, name).weight_loader(
        getattr(layer, name), value, name, shard, e))
    layer.quant_method.process_weights_after_loading(layer)
    assert_experts_match_reference(
        lambda x, weights, ids: layer.quant_method.apply(layer, x, weights, ids, shared_experts=None,
                                                         shared_experts_input=None),
        stored, model["hidden_size"], experts, top_k)


MIXED = [p for p in CHECKPOINTS if json.loads((p / "latentspeed_report.json").read_text())["recipe"] == "mixed"]


@pytest.mark.parametrize("checkpoint", MIXED, ids=lambda p: p.name)
def test_mixed_checkpoint_keeps_its_fp4_experts_on_vllms_method(tp_group, checkpoint):
    from vllm.model_executor.layers.fused_moe.layer import FusedMoE
    from vllm.model_executor.layers.linear import RowParallelLinear

    from vllm_plugin.fp8 import LatentspeedCTConfig, LatentspeedFp8LinearMethod

    model = json.loads((checkpoint / "config.json").read_text())
    config = LatentspeedCTConfig.from_config(model["quantization_config"])
    attention = RowParallelLinear(256, 256, bias=False, quant_config=config, prefix="model.layers.1.self_attn.o_proj")
    assert type(attention.quant_method) is LatentspeedFp8LinearMethod
    experts = next(model[k] for k in ("n_routed_experts", "num_experts", "num_local_experts") if k in model)
    runner = FusedMoE(num_experts=experts, top_k=model["num_experts_per_tok"], hidden_size=model["hidden_size"],
                      intermediate_size=model["moe_intermediate_size"], params_dtype=torch.bfloat16,
                      quant_config=config, prefix="model.layers.1.mlp.experts", renormalize=True)
    assert type(runner.routed_experts.quant_method).__name__ == "CompressedTensorsW4A4Nvfp4MoEMethod"
