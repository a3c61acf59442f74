"""latentspeed_fp8's MoE method inside vLLM 0.26.0's own MoE layer and weight loaders on the CPU,
called as vLLM's MoE runner calls it after routing (the router's top-k is a CUDA op); the fused
MoE runs under Triton's interpreter against the reference."""

import json

import pytest
import torch
from vllm.model_executor.layers.fused_moe.layer import FusedMoE

from common_kernels.fp8.reference import fused_moe_fp8_ref, quantize_weight_blocks_ref
from tests.helpers import assert_close
from tests.vllm_plugin.test_fp8_method import CT_FP8_BLOCK
import vllm_plugin.fp8
from vllm_plugin.fp8 import (
    LatentspeedCTConfig,
    LatentspeedCTFp8MoEMethod,
    LatentspeedFp8Config,
    LatentspeedFp8MoEMethod,
    LatentspeedOnlineFp8MoEMethod,
)

EXPERTS, TOP_K, HIDDEN, INTER = 4, 2, 256, 128


def moe_layer(quant_config, **kwargs):
    return FusedMoE(num_experts=EXPERTS, top_k=TOP_K, hidden_size=HIDDEN, intermediate_size=INTER,
                    params_dtype=torch.bfloat16, quant_config=quant_config, prefix="model.layers.1.mlp.experts",
                    renormalize=True, **kwargs)


def load_experts(runner, weights, scales=None, scale_suffix="_scale_inv"):
    """Each expert's gate (w1), up (w3) and down (w2) through the parameters' own weight loaders
    (for bf16 checkpoints vLLM's online loading, which quantizes once the last expert arrives);
    the scales under ``w13_weight`` / ``w2_weight`` + ``scale_suffix``."""
    experts = runner.routed_experts
    for e, per_shard in enumerate(weights):
        for shard, w in per_shard.items():
            names = [f"{'w2' if shard == 'w2' else 'w13'}_weight"]
            names += [f"{names[0]}{scale_suffix}"] if scales is not None else []
            for name, value in zip(names, (w, scales[e][shard] if scales is not None else None)):
                param = getattr(experts, name)
                param.weight_loader(param, value, name, shard, e)
    if not experts.quant_method.uses_meta_device:
        experts.quant_method.process_weights_after_loading(experts)


def apply(runner, x, topk_weights, topk_ids):
    """What vLLM's MoE runner calls after routing (its router's top-k is a CUDA op)."""
    method = runner.routed_experts.quant_method
    assert not method.is_monolithic and method.moe_kernel is None
    return method.apply(runner.routed_experts, x, topk_weights, topk_ids, shared_experts=None,
                        shared_experts_input=None)


def routing(tokens):
    weights, ids = torch.softmax(torch.randn(tokens, EXPERTS), -1).topk(TOP_K, dim=-1)
    return weights, ids.to(torch.int32)


def stacked(blocks):
    w13 = torch.stack([torch.cat([b["w1"][0], b["w3"][0]]) for b in blocks])
    s13 = torch.stack([torch.cat([b["w1"][1], b["w3"][1]]) for b in blocks])
    return w13, s13, torch.stack([b["w2"][0] for b in blocks]), torch.stack([b["w2"][1] for b in blocks])


@pytest.mark.parametrize("tokens", [1, 19])
def test_deepseek_fp8_experts_run_on_latentspeeds_fused_moe(tp_group, tokens):
    runner = moe_layer(tp_group.quant_config)
    assert type(runner.routed_experts.quant_method) is LatentspeedFp8MoEMethod
    shapes = {"w1": (INTER, HIDDEN), "w3": (INTER, HIDDEN), "w2": (HIDDEN, INTER)}
    blocks = [{k: quantize_weight_blocks_ref(torch.randn(*s) * 0.05) for k, s in shapes.items()} for _ in range(EXPERTS)]
    load_experts(runner, [{k: q for k, (q, _) in b.items()} for b in blocks],
                 [{k: s for k, (_, s) in b.items()} for b in blocks])
    x = torch.randn(tokens, HIDDEN, dtype=torch.bfloat16)
    topk = routing(tokens)

    out = apply(runner, x, *topk)

    expected = fused_moe_fp8_ref(x, *stacked(blocks), *topk)
    assert out.shape == x.shape and out.dtype == torch.bfloat16
    assert_close(out, expected, atol=2e-2, rtol=2e-2, name="moe out")


def test_compressed_tensors_experts_run_on_latentspeeds_fused_moe(tp_group):
    runner = moe_layer(LatentspeedCTConfig.from_config(CT_FP8_BLOCK))
    assert type(runner.routed_experts.quant_method) is LatentspeedCTFp8MoEMethod
    shapes = {"w1": (INTER, HIDDEN), "w3": (INTER, HIDDEN), "w2": (HIDDEN, INTER)}
    blocks = [{k: quantize_weight_blocks_ref(torch.randn(*s) * 0.05) for k, s in shapes.items()} for _ in range(EXPERTS)]
    load_experts(runner, [{k: q for k, (q, _) in b.items()} for b in blocks],
                 [{k: s for k, (_, s) in b.items()} for b in blocks], scale_suffix="_scale")
    x = torch.randn(9, HIDDEN, dtype=torch.bfloat16)
    topk = routing(9)

    out = apply(runner, x, *topk)

    assert_close(out, fused_moe_fp8_ref(x, *stacked(blocks), *topk), atol=2e-2, rtol=2e-2, name="moe out")


def test_compressed_tensors_experts_with_bad_scales_or_other_schemes_are_named(tp_group):
    runner = moe_layer(LatentspeedCTConfig.from_config(CT_FP8_BLOCK))
    shapes = {"w1": (INTER, HIDDEN), "w3": (INTER, HIDDEN), "w2": (HIDDEN, INTER)}
    blocks = [{k: quantize_weight_blocks_ref(torch.randn(*s) * 0.05) for k, s in shapes.items()} for _ in range(EXPERTS)]
    blocks[1]["w1"][1][0, 1] = 0.0
    with pytest.raises(ValueError, match=r"w13\[1\].*not finite and positive"):
        load_experts(runner, [{k: q for k, (q, _) in b.items()} for b in blocks],
                     [{k: s for k, (_, s) in b.items()} for b in blocks], scale_suffix="_scale")
    per_channel = json.loads(json.dumps(CT_FP8_BLOCK))
    per_channel["config_groups"]["group_0"]["weights"].update(strategy="channel", block_structure=None)
    per_channel["config_groups"]["group_0"]["input_activations"].update(strategy="token", group_size=None)
    with pytest.raises(ValueError, match=r"experts of model.layers.1.mlp.experts are quantized as FP8 per tensor"):
        moe_layer(LatentspeedCTConfig.from_config(per_channel))


def test_bf16_experts_are_quantized_at_load_and_run_on_latentspeeds_fused_moe(tp_group):
    runner = moe_layer(LatentspeedFp8Config())
    assert type(runner.routed_experts.quant_method) is LatentspeedOnlineFp8MoEMethod
    shapes = {"w1": (INTER, HIDDEN), "w3": (INTER, HIDDEN), "w2": (HIDDEN, INTER)}
    weights = [{k: (torch.randn(*s) * 0.05).to(torch.bfloat16) for k, s in shapes.items()} for _ in range(EXPERTS)]
    load_experts(runner, weights)
    experts = runner.routed_experts
    assert experts.w13_weight.dtype == torch.float8_e4m3fn and experts.w13_weight_scale_inv.shape == (EXPERTS, 2, 2)
    x = torch.randn(5, HIDDEN, dtype=torch.bfloat16)
    topk = routing(5)

    out = apply(runner, x, *topk)

    expected = fused_moe_fp8_ref(x, experts.w13_weight, experts.w13_weight_scale_inv, experts.w2_weight,
                                 experts.w2_weight_scale_inv, *topk)
    assert_close(out, expected, atol=2e-2, rtol=2e-2, name="moe out")
    dequantized = experts.w2_weight[0].float() * experts.w2_weight_scale_inv[0].repeat_interleave(128, 0)
    assert_close(dequantized, weights[0]["w2"].float(), atol=2e-3, rtol=7e-2, name="quantized w2")


def test_bf16_experts_with_nonfinite_weights_are_refused(tp_group):
    runner = moe_layer(LatentspeedFp8Config())
    shapes = {"w1": (INTER, HIDDEN), "w3": (INTER, HIDDEN), "w2": (HIDDEN, INTER)}
    weights = [{k: torch.randn(*s).to(torch.bfloat16) for k, s in shapes.items()} for _ in range(EXPERTS)]
    weights[2]["w3"][0, 1] = float("nan")
    with pytest.raises(ValueError, match=r"latentspeed_fp8: model.layers.1.mlp.experts w13: the checkpoint holds 1 "
                                         r"non-finite weights, in experts \[2\]"):
        load_experts(runner, weights)


def test_unsupported_moe_layers_are_named(tp_group):
    runner = moe_layer(LatentspeedFp8Config(), activation="gelu")
    shapes = {"w1": (INTER, HIDDEN), "w3": (INTER, HIDDEN), "w2": (HIDDEN, INTER)}
    with pytest.raises(ValueError, match="latentspeed_fp8: .*activation other than SiLU is not supported"):
        load_experts(runner, [{k: torch.randn(*s).to(torch.bfloat16) for k, s in shapes.items()}
                              for _ in range(EXPERTS)])


def test_bad_expert_scales_are_named(tp_group):
    runner = moe_layer(tp_group.quant_config)
    shapes = {"w1": (INTER, HIDDEN), "w3": (INTER, HIDDEN), "w2": (HIDDEN, INTER)}
    blocks = [{k: quantize_weight_blocks_ref(torch.randn(*s) * 0.05) for k, s in shapes.items()} for _ in range(EXPERTS)]
    blocks[3]["w2"][1][1, 0] = float("nan")
    with pytest.raises(ValueError, match=r"w2\[3\].*not finite and positive"):
        load_experts(runner, [{k: q for k, (q, _) in b.items()} for b in blocks],
                     [{k: s for k, (_, s) in b.items()} for b in blocks])


def test_expert_tensors_of_another_dtype_are_refused_by_name(tp_group):
    experts = moe_layer(tp_group.quant_config).routed_experts
    w1 = (torch.randn(INTER, HIDDEN) * 0.05).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"latentspeed_fp8: .* w13 weight: the checkpoint stores torch.bfloat16"):
        experts.w13_weight.weight_loader(experts.w13_weight, w1, "w13_weight", "w1", 0)


def test_expert_map_leaves_other_ranks_experts_out(tp_group):
    """Under expert parallelism vLLM hands apply global ids and the layer's expert map (-1: on
    another rank); here the map is set by hand on a single-rank layer."""
    runner = moe_layer(tp_group.quant_config)
    shapes = {"w1": (INTER, HIDDEN), "w3": (INTER, HIDDEN), "w2": (HIDDEN, INTER)}
    blocks = [{k: quantize_weight_blocks_ref(torch.randn(*s) * 0.05) for k, s in shapes.items()} for _ in range(EXPERTS)]
    load_experts(runner, [{k: q for k, (q, _) in b.items()} for b in blocks],
                 [{k: s for k, (_, s) in b.items()} for b in blocks])
    expert_map = torch.tensor([-1, 0, 1, -1], dtype=torch.int32)
    runner.routed_experts._expert_map = expert_map
    x = torch.randn(6, HIDDEN, dtype=torch.bfloat16)
    topk = routing(6)

    out = apply(runner, x, *topk)

    expected = fused_moe_fp8_ref(x, *stacked(blocks), *topk, expert_map=expert_map)
    assert_close(out, expected, atol=2e-2, rtol=2e-2, name="ep out")


def test_experts_warm_up_for_vllms_largest_batch(tp_group, monkeypatch):
    """On a GPU the experts' kernels compile for every batch size while they load (``tests/gpu/
    test_fp8_warmup.py`` checks that there): what vLLM's own MoE config hands the warm-up."""
    calls = []
    monkeypatch.setattr(vllm_plugin.fp8, "warm_up_moe", lambda *args: calls.append(args))
    runner = moe_layer(tp_group.quant_config)
    shapes = {"w1": (INTER, HIDDEN), "w3": (INTER, HIDDEN), "w2": (HIDDEN, INTER)}
    blocks = [{k: quantize_weight_blocks_ref(torch.randn(*s) * 0.05) for k, s in shapes.items()}
              for _ in range(EXPERTS)]
    load_experts(runner, [{k: q for k, (q, _) in b.items()} for b in blocks],
                 [{k: s for k, (_, s) in b.items()} for b in blocks])
    (w13, w13_scale, w2, w2_scale, top_k, tokens, dtype, expert_map), = calls
    experts = runner.routed_experts
    assert [t.data_ptr() for t in (w13, w13_scale, w2, w2_scale)] == [
        experts.w13_weight.data_ptr(), experts.w13_weight_scale_inv.data_ptr(), experts.w2_weight.data_ptr(),
        experts.w2_weight_scale_inv.data_ptr()]
    assert (top_k, tokens, dtype, expert_map) == (TOP_K, tp_group.scheduler_config.max_num_batched_tokens,
                                                 torch.bfloat16, None)
