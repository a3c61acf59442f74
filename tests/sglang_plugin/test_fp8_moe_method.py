"""latentspeed_fp8's MoE method inside SGLang 0.5.17's own FusedMoE layer and weight loader on the
CPU, called as the layer calls it after routing (SGLang's top-k is a CUDA op); the fused MoE runs
under Triton's interpreter against the reference. SGLang's MoE layer reads the published server
arguments, so this module publishes some for the tiny DeepSeek-V3 (role "test")."""

import copy
import json

import pytest
import torch

pytest.importorskip("sglang")

from sglang.srt import runtime_context  # noqa: E402
from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE  # noqa: E402
from sglang.srt.layers.moe.token_dispatcher import StandardDispatchOutput  # noqa: E402
from sglang.srt.layers.moe.topk import StandardTopKOutput  # noqa: E402
from sglang.srt.runtime_context import get_parallel  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402

import sglang_plugin  # noqa: E402
from common_kernels.fp8.reference import fused_moe_fp8_ref, quantize_weight_blocks_ref  # noqa: E402
from sglang_plugin.fp8 import LatentspeedCTW8A8Fp8MoE, LatentspeedFp8Config, LatentspeedFp8MoEMethod  # noqa: E402
from tests.helpers import assert_close  # noqa: E402
from tests.sglang_plugin.test_fp8_method import CT_FP8_BLOCK, TINY_DEEPSEEK_V3  # noqa: E402

EXPERTS, TOP_K, HIDDEN, INTER = 4, 2, 256, 128
SHAPES = {"w1": (INTER, HIDDEN), "w3": (INTER, HIDDEN), "w2": (HIDDEN, INTER)}


def publish_tiny_deepseek(model) -> None:
    """Publish server arguments for the tiny DeepSeek-V3 (written to ``model``), as SGLang's MoE layer reads them."""
    (model / "config.json").write_text(json.dumps(TINY_DEEPSEEK_V3))
    runtime_context.publish(ServerArgs(model_path=str(model), skip_tokenizer_init=True, device="cpu"), role="test")
    sglang_plugin.register()


@pytest.fixture(scope="module", autouse=True)
def server_args(tmp_path_factory):
    publish_tiny_deepseek(tmp_path_factory.mktemp("tiny-dsv3"))


def moe_layer(quant_config, scaling=1.0, **kwargs):
    with single_rank():
        return FusedMoE(num_experts=EXPERTS, hidden_size=HIDDEN, intermediate_size=INTER, layer_id=1, top_k=TOP_K,
                        params_dtype=torch.bfloat16, quant_config=quant_config, prefix="model.layers.1.mlp.experts",
                        routed_scaling_factor=scaling, **kwargs)


def single_rank():
    return get_parallel().override(tp_size=1, tp_rank=0, moe_ep_size=1, moe_ep_rank=0, moe_tp_size=1, moe_tp_rank=0)


def load_experts(layer, weights, scales=None, scale_suffix="_scale_inv"):
    """Each expert's gate (w1), up (w3) and down (w2) through SGLang's MoE weight loader; the
    scales under ``w13_weight`` / ``w2_weight`` + ``scale_suffix``."""
    for e, per_shard in enumerate(weights):
        for shard, w in per_shard.items():
            name = f"{'w2' if shard == 'w2' else 'w13'}_weight"
            layer.weight_loader(getattr(layer, name), w, name, shard, e)
            if scales is not None:
                scale = name + scale_suffix
                layer.weight_loader(getattr(layer, scale), scales[e][shard], scale, shard, e)
    layer.quant_method.process_weights_after_loading(layer)


def apply(layer, x, weights, ids):
    topk = StandardTopKOutput(weights, ids, torch.zeros(x.shape[0], EXPERTS))
    return layer.quant_method.apply(layer, StandardDispatchOutput(x, None, topk)).hidden_states


def routing(tokens):
    weights, ids = torch.softmax(torch.randn(tokens, EXPERTS), -1).topk(TOP_K, dim=-1)
    return weights, ids.to(torch.int32)


@pytest.mark.parametrize("tokens", [1, 19])
def test_deepseek_fp8_experts_run_on_latentspeeds_fused_moe(tokens):
    config = LatentspeedFp8Config(is_checkpoint_fp8_serialized=True, weight_block_size=[128, 128])
    layer = moe_layer(config, scaling=2.5)
    assert type(layer.quant_method) is LatentspeedFp8MoEMethod
    blocks = [{k: quantize_weight_blocks_ref(torch.randn(*s) * 0.05) for k, s in SHAPES.items()} for _ in range(EXPERTS)]
    load_experts(layer, [{k: q for k, (q, _) in b.items()} for b in blocks],
                 [{k: s for k, (_, s) in b.items()} for b in blocks])
    x = torch.randn(tokens, HIDDEN, dtype=torch.bfloat16)
    weights, ids = routing(tokens)

    out = apply(layer, x, weights, ids)

    w13 = torch.stack([torch.cat([b["w1"][0], b["w3"][0]]) for b in blocks])
    s13 = torch.stack([torch.cat([b["w1"][1], b["w3"][1]]) for b in blocks])
    w2, s2 = torch.stack([b["w2"][0] for b in blocks]), torch.stack([b["w2"][1] for b in blocks])
    expected = fused_moe_fp8_ref(x, w13, s13, w2, s2, weights * 2.5, ids)  # SGLang's runner scales in the MoE
    assert out.shape == x.shape and out.dtype == torch.bfloat16
    assert_close(out, expected, atol=2e-2, rtol=2e-2, name="moe out")


def test_compressed_tensors_experts_run_on_latentspeeds_fused_moe():
    layer = moe_layer(LatentspeedFp8Config.from_config(copy.deepcopy(CT_FP8_BLOCK)), scaling=2.5)
    assert type(layer.scheme) is LatentspeedCTW8A8Fp8MoE
    blocks = [{k: quantize_weight_blocks_ref(torch.randn(*s) * 0.05) for k, s in SHAPES.items()} for _ in range(EXPERTS)]
    load_experts(layer, [{k: q for k, (q, _) in b.items()} for b in blocks],
                 [{k: s for k, (_, s) in b.items()} for b in blocks], scale_suffix="_scale")
    x = torch.randn(11, HIDDEN, dtype=torch.bfloat16)
    weights, ids = routing(11)

    out = apply(layer, x, weights, ids)

    w13 = torch.stack([torch.cat([b["w1"][0], b["w3"][0]]) for b in blocks])
    s13 = torch.stack([torch.cat([b["w1"][1], b["w3"][1]]) for b in blocks])
    w2, s2 = torch.stack([b["w2"][0] for b in blocks]), torch.stack([b["w2"][1] for b in blocks])
    assert_close(out, fused_moe_fp8_ref(x, w13, s13, w2, s2, weights * 2.5, ids), atol=2e-2, rtol=2e-2,
                 name="moe out")


def test_compressed_tensors_experts_with_bad_scales_or_other_schemes_are_named():
    layer = moe_layer(LatentspeedFp8Config.from_config(copy.deepcopy(CT_FP8_BLOCK)))
    blocks = [{k: quantize_weight_blocks_ref(torch.randn(*s) * 0.05) for k, s in SHAPES.items()} for _ in range(EXPERTS)]
    blocks[0]["w2"][1][1, 0] = float("inf")
    with pytest.raises(ValueError, match=r"latentspeed_fp8: .*w2\[0\].*not finite and positive"):
        load_experts(layer, [{k: q for k, (q, _) in b.items()} for b in blocks],
                     [{k: s for k, (_, s) in b.items()} for b in blocks], scale_suffix="_scale")
    per_channel = copy.deepcopy(CT_FP8_BLOCK)
    per_channel["config_groups"]["group_0"]["weights"].update(strategy="channel", block_structure=None)
    per_channel["config_groups"]["group_0"]["input_activations"].update(strategy="token", group_size=None)
    with pytest.raises(ValueError, match=r"experts of model.layers.1.mlp.experts are quantized as FP8 per tensor"):
        moe_layer(LatentspeedFp8Config.from_config(per_channel))


def test_expert_tensors_of_another_dtype_are_refused_by_name():
    ct = moe_layer(LatentspeedFp8Config.from_config(copy.deepcopy(CT_FP8_BLOCK)))
    with pytest.raises(ValueError, match=r"latentspeed_fp8: .* w2 weight: the checkpoint stores torch.bfloat16"):
        ct.w2_weight.weight_loader(ct.w2_weight, torch.randn(HIDDEN, INTER).to(torch.bfloat16), "w2_weight", "w2", 0)
    native = moe_layer(LatentspeedFp8Config(is_checkpoint_fp8_serialized=True, weight_block_size=[128, 128]))
    scales = torch.ones(INTER // 128, HIDDEN // 128, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"latentspeed_fp8: .* w13 scales: the checkpoint stores torch.int32"):
        native.w13_weight_scale_inv.weight_loader(native.w13_weight_scale_inv, scales, "w13_weight_scale_inv", "w1", 0)


def test_bf16_experts_are_quantized_after_loading():
    layer = moe_layer(LatentspeedFp8Config())
    weights = [{k: (torch.randn(*s) * 0.05).to(torch.bfloat16) for k, s in SHAPES.items()} for _ in range(EXPERTS)]
    load_experts(layer, weights)
    assert layer.w13_weight.dtype == torch.float8_e4m3fn and layer.w13_weight_scale_inv.shape == (EXPERTS, 2, 2)
    dequantized = layer.w2_weight[1].float() * layer.w2_weight_scale_inv[1].repeat_interleave(128, 0)
    assert_close(dequantized, weights[1]["w2"].float(), atol=2e-3, rtol=7e-2, name="quantized w2")
    x = torch.randn(6, HIDDEN, dtype=torch.bfloat16)
    weights_k, ids = routing(6)
    expected = fused_moe_fp8_ref(x, layer.w13_weight, layer.w13_weight_scale_inv, layer.w2_weight,
                                 layer.w2_weight_scale_inv, weights_k, ids)
    assert_close(apply(layer, x, weights_k, ids), expected, atol=2e-2, rtol=2e-2, name="moe out")


def test_expert_parallel_rank_leaves_other_ranks_experts_out():
    """Rank 1 of 2 holds global experts 2 and 3; SGLang's dispatcher hands it local ids, -1 elsewhere."""
    with get_parallel().override(tp_size=2, tp_rank=1, moe_ep_size=2, moe_ep_rank=1, moe_tp_size=1, moe_tp_rank=0):
        layer = FusedMoE(num_experts=EXPERTS, hidden_size=HIDDEN, intermediate_size=INTER, layer_id=1, top_k=TOP_K,
                         params_dtype=torch.bfloat16, quant_config=LatentspeedFp8Config(),
                         prefix="model.layers.1.mlp.experts")
        weights = [{k: (torch.randn(*s) * 0.05).to(torch.bfloat16) for k, s in SHAPES.items()} for _ in range(EXPERTS)]
        load_experts(layer, weights)  # the loader keeps this rank's experts only
    assert layer.w13_weight.shape[0] == 2
    x = torch.randn(7, HIDDEN, dtype=torch.bfloat16)
    weights_k, global_ids = routing(7)
    local_ids = torch.where(global_ids >= 2, global_ids - 2, -1).to(torch.int32)

    out = apply(layer, x, weights_k, local_ids)

    expected = fused_moe_fp8_ref(x, layer.w13_weight, layer.w13_weight_scale_inv, layer.w2_weight,
                                 layer.w2_weight_scale_inv, weights_k, global_ids,
                                 expert_map=torch.tensor([-1, -1, 0, 1]))
    assert_close(out, expected, atol=2e-2, rtol=2e-2, name="ep out")


def test_nonfinite_bf16_experts_and_unsupported_variants_are_named():
    layer = moe_layer(LatentspeedFp8Config())
    weights = [{k: torch.randn(*s).to(torch.bfloat16) for k, s in SHAPES.items()} for _ in range(EXPERTS)]
    weights[2]["w3"][4, 5] = float("inf")
    with pytest.raises(ValueError, match=r"latentspeed_fp8: .*experts w13: the checkpoint holds 1 non-finite weights, "
                                         r"in experts \[2\]"):
        load_experts(layer, weights)
    with pytest.raises(ValueError, match="activation other than SiLU is not supported"):
        moe_layer(LatentspeedFp8Config(), activation="gelu")


def test_warm_up_bound_comes_from_the_published_server_args():
    """The fp8 warm-up's largest batch (it runs on GPUs only): SGLang's prefill chunk, or its
    prefill budget where chunking is off."""
    from sglang.srt.server_args import get_global_server_args

    from sglang_plugin.fp8 import _max_tokens

    args = get_global_server_args()
    expected = args.chunked_prefill_size if (args.chunked_prefill_size or 0) > 0 else args.max_prefill_tokens
    assert isinstance(expected, int) and expected > 0 and _max_tokens() == expected
