"""``--quantization latentspeed_fp8`` against SGLang 0.5.17's own registry, model config, linear
layers and loaders; the GEMM runs under Triton's interpreter against the reference."""

import argparse
import json
from unittest import mock

import pytest
import torch

pytest.importorskip("sglang")

from sglang.srt.configs.model_config import ModelConfig  # noqa: E402
from sglang.srt.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear  # noqa: E402
from sglang.srt.layers.quantization import QUANTIZATION_METHODS  # noqa: E402
from sglang.srt.runtime_context import get_parallel  # noqa: E402
from sglang.srt.server_args import QUANTIZATION_CHOICES, ServerArgs  # noqa: E402

import sglang_plugin  # noqa: E402
from common_kernels.fp8.reference import block_scaled_gemm_ref, quantize_per_token_group_ref, quantize_weight_blocks_ref  # noqa: E402,E501
from sglang_plugin.fp8 import NAME, LatentspeedCTConfig, LatentspeedFp8Config, LatentspeedFp8LinearMethod  # noqa: E402
from tests.helpers import assert_close  # noqa: E402

DEEPSEEK_FP8 = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic", "fmt": "e4m3"}
CT_FP8_BLOCK = {
    "quant_method": "compressed-tensors", "format": "float-quantized",
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": "block",
                    "block_structure": [128, 128]},
        "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True, "strategy": "group",
                              "group_size": 128}}},
    "ignore": ["lm_head"],
}
TINY_DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 256, "intermediate_size": 512,
    "moe_intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
    "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2, "q_lora_rank": 128, "kv_lora_rank": 128,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 1000,
    "max_position_embeddings": 4096, "torch_dtype": "bfloat16", "first_k_dense_replace": 1,
}


@pytest.fixture(autouse=True)
def registered():
    sglang_plugin.register()


def test_method_is_registered_once():
    sglang_plugin.register()
    assert QUANTIZATION_METHODS[NAME] is LatentspeedFp8Config and QUANTIZATION_CHOICES.count(NAME) == 1
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    assert parser.parse_args(["--model-path", "m", "--quantization", NAME]).quantization == NAME


@pytest.mark.parametrize("quant_cfg", [DEEPSEEK_FP8, CT_FP8_BLOCK], ids=["deepseek_fp8", "compressed_tensors"])
def test_checkpoints_are_claimed_only_when_asked(tmp_path, quant_cfg):
    (tmp_path / "config.json").write_text(json.dumps({**TINY_DEEPSEEK_V3, "quantization_config": quant_cfg}))
    assert ModelConfig(model_path=str(tmp_path), quantization=NAME).quantization == NAME
    assert ModelConfig(model_path=str(tmp_path)).quantization == quant_cfg["quant_method"]


@pytest.mark.parametrize(
    "quant_cfg,reason",
    [(dict(DEEPSEEK_FP8, weight_block_size=[64, 64]), r"weight block \[64, 64\] is not supported"),
     ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "per-tensor"),
     (dict(DEEPSEEK_FP8, activation_scheme="static"), "activation_scheme 'static' is not supported")],
    ids=["block64", "per_tensor", "static"],
)
def test_unsupported_checkpoints_are_named(quant_cfg, reason):
    with pytest.raises(ValueError, match=reason):
        LatentspeedFp8Config.from_config(quant_cfg)


def reference(x, q, scales):
    a, a_scale = quantize_per_token_group_ref(x)
    return block_scaled_gemm_ref(a, a_scale, q, scales)


def test_merged_layer_matches_reference():
    config = LatentspeedFp8Config.from_config(DEEPSEEK_FP8)
    with get_parallel().override(tp_size=1, tp_rank=0):
        layer = MergedColumnParallelLinear(256, [384, 256], bias=False, quant_config=config,
                                           params_dtype=torch.bfloat16, prefix="model.layers.0.mlp.gate_up_proj")
    assert type(layer.quant_method) is LatentspeedFp8LinearMethod
    shards = [quantize_weight_blocks_ref(torch.randn(n, 256) * 0.05) for n in (384, 256)]
    for shard_id, (q, s) in enumerate(shards):
        layer.weight.weight_loader(layer.weight, q, shard_id)
        layer.weight_scale_inv.weight_loader(layer.weight_scale_inv, s, shard_id)
    layer.quant_method.process_weights_after_loading(layer)
    x = torch.randn(2, 5, 256, dtype=torch.bfloat16)
    out, _ = layer(x)
    expected = torch.cat([reference(x.view(-1, 256), q, s) for q, s in shards], dim=1).view(2, 5, 640)
    assert_close(out, expected, atol=2e-2, rtol=1e-2, name="gate_up out")


def test_tensors_of_another_dtype_than_the_config_are_refused_by_name():
    config = LatentspeedFp8Config.from_config(DEEPSEEK_FP8)
    with get_parallel().override(tp_size=1, tp_rank=0):
        layer = ColumnParallelLinear(256, 256, bias=False, quant_config=config, params_dtype=torch.bfloat16,
                                     prefix="model.layers.0.mlp.up_proj")
    q, scales = quantize_weight_blocks_ref(torch.randn(256, 256) * 0.05)
    with pytest.raises(ValueError, match=r"latentspeed_fp8: model.layers.0.mlp.up_proj weight: the checkpoint stores "
                                         r"torch.bfloat16, but its quantization config implies torch.float8_e4m3fn"):
        layer.weight.weight_loader(layer.weight, q.to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"up_proj scales: the checkpoint stores torch.int32"):
        layer.weight_scale_inv.weight_loader(layer.weight_scale_inv, scales.to(torch.int32))


def test_bf16_checkpoint_is_quantized_after_loading():
    with get_parallel().override(tp_size=1, tp_rank=0):
        layer = ColumnParallelLinear(256, 384, bias=False, quant_config=LatentspeedFp8Config(),
                                     params_dtype=torch.bfloat16, prefix="model.layers.0.mlp.up_proj")
    dense = torch.randn(384, 256, dtype=torch.bfloat16) * 0.05
    layer.weight.weight_loader(layer.weight, dense)
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale_inv.shape == (3, 2)
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    out, _ = layer(x)
    assert_close(out, reference(x, layer.weight, layer.weight_scale_inv), atol=2e-2, rtol=1e-2, name="online out")
    exact = x.float() @ dense.float().T
    assert ((out.float() - exact).norm() / exact.norm()).item() < 0.05


def test_compressed_tensors_block_layers_use_our_gemm():
    config = LatentspeedFp8Config.from_config(dict(CT_FP8_BLOCK))
    assert type(config) is LatentspeedCTConfig and config.get_name() == NAME
    with mock.patch("torch.cuda.get_device_capability", return_value=(9, 0)), \
            get_parallel().override(tp_size=1, tp_rank=0):
        layer = ColumnParallelLinear(256, 256, bias=False, quant_config=config, params_dtype=torch.bfloat16,
                                     prefix="model.layers.0.self_attn.o_proj")
    q, s = quantize_weight_blocks_ref(torch.randn(256, 256) * 0.05)
    layer.weight.weight_loader(layer.weight, q)
    layer.weight_scale.weight_loader(layer.weight_scale, s)
    layer.quant_method.process_weights_after_loading(layer)
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    assert_close(layer(x)[0], reference(x, q, s), atol=2e-2, rtol=1e-2, name="compressed-tensors out")


def test_compressed_tensors_block_scales_of_fused_layers_load_whatever_the_targets():
    """SGLang loads each half of a fused layer's block scales at an offset computed from the config's
    weight block size, which its own config finds only in a group that targets the class Linear. A
    checkpoint whose groups name layers (latentspeed's fp8 recipes did until 2026-12-01; other tools
    may) failed there on the H200 (refmodel-eval-2026-12-01): ours finds the block in any group."""
    named = dict(CT_FP8_BLOCK, config_groups={"group_0": dict(CT_FP8_BLOCK["config_groups"]["group_0"],
                                                              targets=[r"re:.*mlp\.(gate_up|down)_proj$"])})
    config = LatentspeedFp8Config.from_config(named)
    assert config.weight_block_size == [128, 128]
    with mock.patch("torch.cuda.get_device_capability", return_value=(9, 0)), \
            get_parallel().override(tp_size=1, tp_rank=0):
        layer = MergedColumnParallelLinear(256, [256, 128], bias=False, quant_config=config,
                                           params_dtype=torch.bfloat16, prefix="model.layers.0.mlp.gate_up_proj")
    halves = [quantize_weight_blocks_ref(torch.randn(rows, 256) * 0.05) for rows in (256, 128)]
    for shard, (q, s) in enumerate(halves):
        layer.weight.weight_loader(layer.weight, q, shard)
        layer.weight_scale.weight_loader(layer.weight_scale, s, shard)
    layer.quant_method.process_weights_after_loading(layer)
    q, s = torch.cat([q for q, _ in halves]), torch.cat([s for _, s in halves])
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    assert_close(layer(x)[0], reference(x, q, s), atol=2e-2, rtol=1e-2, name="fused layer out")


@pytest.mark.parametrize("bad", ["missing", "nan"])
def test_bad_scales_are_named(bad):
    config = LatentspeedFp8Config.from_config(DEEPSEEK_FP8)
    with get_parallel().override(tp_size=1, tp_rank=0):
        layer = ColumnParallelLinear(256, 256, bias=False, quant_config=config, params_dtype=torch.bfloat16,
                                     prefix="model.layers.0.mlp.up_proj")
    q, s = quantize_weight_blocks_ref(torch.randn(256, 256))
    layer.weight.weight_loader(layer.weight, q)
    if bad == "nan":
        s[0, 0] = float("nan")
        layer.weight_scale_inv.weight_loader(layer.weight_scale_inv, s)
    reason = "no scale for some weight blocks" if bad == "missing" else "not finite and positive"
    with pytest.raises(ValueError, match=f"{NAME}: model.layers.0.mlp.up_proj: .*{reason}"):
        layer.quant_method.process_weights_after_loading(layer)


def test_bf16_checkpoint_with_nonfinite_weights_is_refused():
    with get_parallel().override(tp_size=1, tp_rank=0):
        layer = ColumnParallelLinear(256, 128, bias=False, quant_config=LatentspeedFp8Config(),
                                     params_dtype=torch.bfloat16, prefix="model.layers.0.mlp.up_proj")
    weight = torch.randn(128, 256, dtype=torch.bfloat16)
    weight[0, 0] = float("inf")
    layer.weight.weight_loader(layer.weight, weight)
    with pytest.raises(ValueError, match=f"{NAME}: .*the checkpoint holds 1 non-finite weights"):
        layer.quant_method.process_weights_after_loading(layer)
