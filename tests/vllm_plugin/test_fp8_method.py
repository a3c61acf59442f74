"""``--quantization latentspeed_fp8`` against vLLM 0.26.0's own config resolution, linear layers
and weight loaders; the GEMM runs under Triton's interpreter and is compared with the reference.

vLLM's linear layers need a tensor-parallel group (world size 1, gloo) and a current config.
"""

import json

import pytest
import torch
from vllm.config import VllmConfig
from vllm.model_executor.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear
from vllm.model_executor.layers.quantization.utils.quant_utils import get_and_maybe_dequant_weights

import vllm_plugin.fp8
from common_kernels.fp8.reference import block_scaled_gemm_ref, quantize_per_token_group_ref, quantize_weight_blocks_ref
from common_kernels.guard import fp8_guard
from tests.helpers import assert_close
from tests.vllm_plugin.conftest import DEEPSEEK_FP8, model_config
from vllm_plugin.fp8 import NAME, LatentspeedCTConfig, LatentspeedFp8Config, LatentspeedFp8LinearMethod

# What llm-compressor writes for an FP8 block recipe (compressed-tensors "float-quantized").
CT_FP8_BLOCK = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "block",
                        "block_structure": [128, 128], "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "group",
                                  "group_size": 128, "dynamic": True},
        }
    },
    "ignore": ["lm_head"],
}


@pytest.mark.parametrize(
    "quant_cfg,expected",
    [(DEEPSEEK_FP8, LatentspeedFp8Config), (CT_FP8_BLOCK, LatentspeedCTConfig), (None, LatentspeedFp8Config)],
    ids=["deepseek_fp8", "compressed_tensors", "bf16"],
)
def test_method_claims_each_checkpoint_format(hopper_quant, tmp_path, quant_cfg, expected):
    config = VllmConfig(model_config=model_config(tmp_path, quant_cfg))
    assert config.model_config.quantization == NAME
    assert type(config.quant_config) is expected
    if expected is LatentspeedFp8Config:
        assert config.quant_config.is_checkpoint_fp8_serialized == (quant_cfg is not None)


def test_fp8_checkpoints_stay_vllms_unless_asked(hopper_quant, tmp_path):
    assert model_config(tmp_path, DEEPSEEK_FP8, quantization=None).quantization == "fp8"


@pytest.mark.parametrize(
    "quant_cfg,reason",
    [
        (dict(DEEPSEEK_FP8, weight_block_size=[64, 64]), r"weight block \[64, 64\] is not supported"),
        ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "per-tensor"),
        (dict(DEEPSEEK_FP8, activation_scheme="static"), "activation_scheme 'static' is not supported"),
    ],
    ids=["block64", "per_tensor", "static_activations"],
)
def test_unsupported_checkpoints_are_named(hopper_quant, tmp_path, quant_cfg, reason):
    with pytest.raises(ValueError, match=reason):
        VllmConfig(model_config=model_config(tmp_path, quant_cfg))


def load_blocks(layer, shards, scale_name="weight_scale_inv"):
    """Load ``[(q, scales), ...]`` shards through the layer's own (v2) weight loader."""
    for shard_id, (q, scales) in enumerate(shards):
        shard = shard_id if len(shards) > 1 else None
        layer.weight_loader_v2(layer.weight, q, *([shard] if shard is not None else []))
        layer.weight_loader_v2(getattr(layer, scale_name), scales, *([shard] if shard is not None else []))


def reference(x, q, scales):
    a, a_scale = quantize_per_token_group_ref(x)
    return block_scaled_gemm_ref(a, a_scale, q, scales)


@pytest.mark.parametrize("tokens", [1, 37])
def test_merged_column_layer_matches_reference(tp_group, tokens):
    """Two shards of ragged widths (384 and 200 rows: the last scale block is partial)."""
    layer = MergedColumnParallelLinear(256, [384, 200], bias=False, quant_config=tp_group.quant_config,
                                       prefix="model.layers.1.mlp.gate_up_proj")
    assert type(layer.quant_method) is LatentspeedFp8LinearMethod
    shards = [quantize_weight_blocks_ref(torch.randn(n, 256) * 0.05) for n in (384, 200)]
    load_blocks(layer, shards)
    layer.quant_method.process_weights_after_loading(layer)
    x = torch.randn(tokens, 256, dtype=torch.bfloat16)
    out, _ = layer(x)
    expected = torch.cat([reference(x, q, s) for q, s in shards], dim=1)
    assert out.shape == (tokens, 584) and out.dtype == torch.bfloat16
    assert_close(out, expected, atol=2e-2, rtol=1e-2, name="gate_up out")


def test_tensors_of_another_dtype_than_the_config_are_refused_by_name(tp_group):
    """Through the parameters' own loaders, as vLLM's model loader calls them: a bf16 weight or
    an integer scale under an FP8 config is refused; fp8 weights with bf16 scales load and run."""
    layer = MergedColumnParallelLinear(256, [128, 256], bias=False, quant_config=tp_group.quant_config,
                                       prefix="model.layers.0.mlp.gate_up_proj")
    shards = [quantize_weight_blocks_ref(torch.randn(n, 256) * 0.05) for n in (128, 256)]
    with pytest.raises(ValueError, match=r"latentspeed_fp8: model.layers.0.mlp.gate_up_proj weight: the checkpoint "
                                         r"stores torch.bfloat16, but its quantization config implies torch.float8_e4m3fn"):
        layer.weight.weight_loader(layer.weight, shards[1][0].to(torch.bfloat16), 1)
    with pytest.raises(ValueError, match=r"gate_up_proj scales: the checkpoint stores torch.int32"):
        layer.weight_scale_inv.weight_loader(layer.weight_scale_inv, shards[0][1].to(torch.int32), 0)
    for shard_id, (q, scales) in enumerate(shards):
        layer.weight.weight_loader(layer.weight, q, shard_id)
        layer.weight_scale_inv.weight_loader(layer.weight_scale_inv, scales.bfloat16(), shard_id)
    layer.quant_method.process_weights_after_loading(layer)
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    expected = torch.cat([reference(x, q, scales.bfloat16().float()) for q, scales in shards], dim=1)
    assert_close(layer(x)[0], expected, atol=2e-2, rtol=1e-2, name="gate_up out")


def test_row_layer_with_bias_and_ragged_k(tp_group):
    """K = 320 is not a multiple of 128: the last activation group and weight block are partial."""
    layer = RowParallelLinear(320, 256, bias=True, quant_config=tp_group.quant_config,
                              prefix="model.layers.0.mlp.down_proj")
    q, s = quantize_weight_blocks_ref(torch.randn(256, 320) * 0.05)
    load_blocks(layer, [(q, s)])
    bias = torch.randn(256, dtype=torch.bfloat16)
    layer.weight_loader(layer.bias, bias)
    layer.quant_method.process_weights_after_loading(layer)
    x = torch.randn(9, 320, dtype=torch.bfloat16)
    out, _ = layer(x)
    assert_close(out, reference(x, q, s) + bias.float(), atol=2e-2, rtol=1e-2, name="down out")


def test_layers_warm_up_for_vllms_largest_batch(tp_group, monkeypatch):
    """On a GPU a layer's kernels compile for every batch size while it loads (``tests/gpu/
    test_fp8_warmup.py`` checks that there): what vLLM's own config hands the warm-up."""
    calls = []
    monkeypatch.setattr(vllm_plugin.fp8, "warmup_wanted", lambda device: True)
    for name in ("warm_up_linear", "warm_up_producers"):
        monkeypatch.setattr(vllm_plugin.fp8, name, lambda *args, name=name: calls.append((name, *args)))
    layer = RowParallelLinear(320, 256, bias=False, quant_config=tp_group.quant_config,
                              prefix="model.layers.0.mlp.down_proj")
    q, s = quantize_weight_blocks_ref(torch.randn(256, 320) * 0.05)
    load_blocks(layer, [(q, s)])
    layer.quant_method.process_weights_after_loading(layer)
    max_tokens = tp_group.scheduler_config.max_num_batched_tokens
    (_, weight, scale, tokens, dtype), (_, cols, *producers) = calls
    assert torch.equal(weight.view(torch.uint8), q.view(torch.uint8)) and torch.equal(scale, s)
    assert (tokens, dtype) == (max_tokens, torch.bfloat16)
    assert (cols, *producers) == (320, max_tokens, torch.bfloat16, weight.device,
                                  *vllm_plugin.fusion.fused_producers(tp_group))


def test_kv_b_proj_dequantizes_exactly(tp_group):
    """MLA absorbs kv_b_proj into the queries from its dequantized weight (vLLM's exact path)."""
    layer = ColumnParallelLinear(512, 16 * 256, bias=False, quant_config=tp_group.quant_config,
                                 prefix="model.layers.0.self_attn.kv_b_proj")
    q, s = quantize_weight_blocks_ref(torch.randn(16 * 256, 512) * 0.05)
    load_blocks(layer, [(q, s)])
    layer.quant_method.process_weights_after_loading(layer)
    weight = get_and_maybe_dequant_weights(layer, out_dtype=torch.float32)
    expected = q.float() * s.repeat_interleave(128, 0).repeat_interleave(128, 1)
    assert torch.equal(weight, expected)


@pytest.mark.parametrize("bad", ["missing", "nan", "negative", "shape"])
def test_bad_scales_are_named(tp_group, bad):
    layer = ColumnParallelLinear(256, 256, bias=False, quant_config=tp_group.quant_config,
                                 prefix="model.layers.0.mlp.up")
    q, s = quantize_weight_blocks_ref(torch.randn(256, 256))
    layer.weight_loader_v2(layer.weight, q)
    if bad == "nan":
        s[1, 0] = float("nan")
    if bad == "negative":
        s[0, 1] = -s[0, 1]
    if bad != "missing":
        layer.weight_loader_v2(layer.weight_scale_inv, s)
    if bad == "shape":
        layer.weight_scale_inv.data = s[:1]
    reason = {"missing": "no scale for some weight blocks", "nan": "not finite and positive",
              "negative": "not finite and positive", "shape": r"must be \[2, 2\]"}[bad]
    with pytest.raises(ValueError, match=f"{NAME}: model.layers.0.mlp.up: .*{reason}"):
        layer.quant_method.process_weights_after_loading(layer)


def test_compressed_tensors_layers_read_weight_scale(tp_group):
    config = LatentspeedCTConfig.from_config(CT_FP8_BLOCK)
    layer = ColumnParallelLinear(256, 384, bias=False, quant_config=config, prefix="model.layers.0.mlp.up_proj")
    assert type(layer.quant_method) is LatentspeedFp8LinearMethod and hasattr(layer, "weight_scale")
    q, s = quantize_weight_blocks_ref(torch.randn(384, 256) * 0.05)
    load_blocks(layer, [(q, s)], scale_name="weight_scale")
    layer.quant_method.process_weights_after_loading(layer)
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    assert_close(layer(x)[0], reference(x, q, s), atol=2e-2, rtol=1e-2, name="compressed-tensors out")
    head = ColumnParallelLinear(256, 384, bias=False, quant_config=config, prefix="lm_head")
    assert type(head.quant_method).__name__ == "UnquantizedLinearMethod"


def test_compressed_tensors_per_channel_is_refused(tp_group):
    per_channel = json.loads(json.dumps(CT_FP8_BLOCK))
    per_channel["config_groups"]["group_0"]["weights"].update(strategy="channel", block_structure=None)
    per_channel["config_groups"]["group_0"]["input_activations"].update(strategy="token", group_size=None)
    config = LatentspeedCTConfig.from_config(per_channel)
    with pytest.raises(ValueError, match="only FP8 in 128 x 128 blocks is supported"):
        ColumnParallelLinear(256, 256, bias=False, quant_config=config, prefix="model.layers.0.mlp.up_proj")


def test_activation_overflow_and_nan_are_counted(tp_group):
    layer = ColumnParallelLinear(256, 128, bias=False, quant_config=tp_group.quant_config,
                                 prefix="model.layers.0.mlp.up")
    load_blocks(layer, [quantize_weight_blocks_ref(torch.randn(128, 256))])
    layer.quant_method.process_weights_after_loading(layer)
    guard = fp8_guard("cpu")
    before = guard.counters.clone()
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    x[1, 5] = float("nan")
    layer(x)
    assert (guard.counters - before).tolist()[1] >= 1


def test_bf16_checkpoint_is_quantized_while_loading(tp_group):
    """A bf16 linear layer is quantized to 128 x 128 blocks when its last shard arrives."""
    layer = MergedColumnParallelLinear(256, [256, 128], bias=False, quant_config=LatentspeedFp8Config(),
                                       prefix="model.layers.1.mlp.gate_up_proj")
    weights = [torch.randn(n, 256, dtype=torch.bfloat16) * 0.05 for n in (256, 128)]
    for shard_id, w in enumerate(weights):
        layer.weight.weight_loader(layer.weight, w, shard_id)
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale_inv.shape == (3, 2)
    x = torch.randn(6, 256, dtype=torch.bfloat16)
    out, _ = layer(x)
    dense = torch.cat(weights).float()
    assert_close(out, reference(x, layer.weight, layer.weight_scale_inv), atol=2e-2, rtol=1e-2, name="online out")
    rel = ((out.float() - x.float() @ dense.T).norm() / (x.float() @ dense.T).norm()).item()
    assert rel < 0.05, f"block-fp8 layer is {rel:.3f} away from the bf16 layer"


def test_bf16_checkpoint_with_nonfinite_weights_is_refused(tp_group):
    layer = ColumnParallelLinear(256, 128, bias=False, quant_config=LatentspeedFp8Config(),
                                 prefix="model.layers.0.mlp.up_proj")
    weight = torch.randn(128, 256, dtype=torch.bfloat16)
    weight[5, 7] = float("nan")
    with pytest.raises(ValueError, match=f"{NAME}: model.layers.0.mlp.up_proj: the checkpoint holds 1 non-finite"):
        layer.weight.weight_loader(layer.weight, weight)


def test_deepseek_v3_fused_qkv_a_proj_leaves_vllms_bf16_gemm_once_quantized(tp_group, monkeypatch):
    """At DeepSeek-V3's widths on Hopper, vLLM builds ``fused_qkv_a_proj`` to call its bf16-only
    small-batch GEMM (decided while the weight is still bf16); quantized at load, the layer must
    run on latentspeed's GEMM instead (on the H200 the engine otherwise stopped with "expected
    mat1 and mat2 to have the same dtype")."""
    from vllm import platforms
    from vllm.model_executor.models import deepseek_v2

    monkeypatch.setattr(deepseek_v2, "current_platform", platforms._current_platform)  # the fake H200
    # the reference quantizer: the interpreter takes about a second a 128 x 128 block (16 min here)
    monkeypatch.setattr(vllm_plugin.fp8, "quantize_linear_weight", lambda name, w: quantize_weight_blocks_ref(w))
    layer = deepseek_v2.DeepSeekV2FusedQkvAProjLinear(7168, [1536, 576], quant_config=LatentspeedFp8Config(),
                                                       prefix="model.layers.0.self_attn.fused_qkv_a_proj")
    assert layer._use_min_latency_gemm  # vLLM's choice at construction, with a bf16 weight
    weights = [torch.randn(n, 7168, dtype=torch.bfloat16) * 0.02 for n in (1536, 576)]
    for shard_id, w in enumerate(weights):
        layer.weight.weight_loader(layer.weight, w, shard_id)
    assert layer.weight.dtype == torch.float8_e4m3fn and not layer._use_min_latency_gemm
    x = torch.randn(2, 7168, dtype=torch.bfloat16)
    out = layer(x)
    out = out[0] if isinstance(out, tuple) else out
    assert_close(out, reference(x, layer.weight, layer.weight_scale_inv), atol=2e-2, rtol=1e-2, name="fused_qkv_a")
