"""The producer + fp8 quantization fusion pass (``vllm_plugin/fusion.py``) on graphs built from
vLLM 0.26.0's own ``vllm.ir`` norm ops and native ``SiluAndMul`` and latentspeed's linear op, as
vLLM's compiler hands them to post-grad passes; the rewritten graphs then run (Triton's
interpreter) against the originals."""

import pytest
import torch
import vllm.ir.ops
from torch._inductor.decomposition import select_decomp_table
from torch.fx.experimental.proxy_tensor import make_fx
from vllm.compilation.passes.vllm_inductor_pass import get_match_table
from vllm.config import CompilationConfig, CompilationMode, DeviceConfig, VllmConfig
from vllm.model_executor.layers.activation import SiluAndMul

import vllm_plugin.fp8  # noqa: F401  (registers torch.ops.latentspeed.block_fp8_linear)
from common_kernels.fp8 import quantize_weight_blocks
from common_kernels.guard import fp8_guard
from tests.helpers import assert_close
from vllm_plugin import fusion

LINEAR = torch.ops.latentspeed.block_fp8_linear.default
NORM_OPS = {torch.ops.vllm_ir.rms_norm.default, torch.ops.vllm_ir.fused_add_rms_norm.default}
FUSED_OPS = {torch.ops.latentspeed.rms_norm_group_quant.default, torch.ops.latentspeed.add_rms_norm_group_quant.default}
SILU_QUANT = torch.ops.latentspeed.silu_mul_group_quant.default


def weights(n, k, seed):
    gen = torch.Generator().manual_seed(seed)
    return quantize_weight_blocks((torch.randn(n, k, generator=gen) / k**0.5).contiguous())


def decoder_slice(x, residual, w_in, w_a, s_a, w_q, w_b, s_b, w_gate):
    """DeepSeek-V3's shapes of use: input_layernorm with the residual into one linear,
    q_a_layernorm into another, and a norm whose output also feeds a bf16 router (not fusable)."""
    h, residual = vllm.ir.ops.fused_add_rms_norm(x, residual, w_in, 1e-6)
    q = vllm.ir.ops.rms_norm(torch.ops.latentspeed.block_fp8_linear(h, w_a, s_a), w_q, 1e-6)
    out = torch.ops.latentspeed.block_fp8_linear(q, w_b, s_b)
    shared = vllm.ir.ops.rms_norm(out, w_in, 1e-6)
    return torch.ops.latentspeed.block_fp8_linear(shared, w_a, s_a) + shared @ w_gate, residual


def inputs(dtype):
    gen = torch.Generator().manual_seed(0)
    hidden, q_rank = 384, 256
    w_a, s_a = weights(q_rank, hidden, 1)
    w_b, s_b = weights(hidden, q_rank, 2)
    return (torch.randn(5, hidden, generator=gen).to(dtype), torch.randn(5, hidden, generator=gen).to(dtype),
            (torch.rand(hidden, generator=gen) + 0.5).to(dtype), w_a, s_a, (torch.rand(q_rank, generator=gen) + 0.5)
            .to(dtype), w_b, s_b, torch.randn(hidden, q_rank, generator=gen).to(dtype) / 16)


def assert_counts_nonfinite(gm, args):
    """Running the rewritten graph on inputs holding a NaN moves the guard's non-finite counter."""
    counters = fp8_guard("cpu").counters
    counters.zero_()
    gm(*args)
    assert counters[1] > 0, "NaN activations went through the fused quantization uncounted"
    counters.zero_()


def compiling_config(mode=CompilationMode.VLLM_COMPILE):
    return VllmConfig(device_config=DeviceConfig("cpu"), compilation_config=CompilationConfig(mode=mode))


def targets(gm):
    return [node.target for node in gm.graph.nodes if node.op == "call_function"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_pass_fuses_the_norms_that_feed_only_a_linear(dtype):
    args = inputs(dtype)
    gm = make_fx(decoder_slice, tracing_mode="fake")(*args)
    assert sum(t in NORM_OPS for t in targets(gm)) == 3
    expected = gm(*args)
    fusion_pass = fusion.QuantFusionPass(compiling_config())
    before = get_match_table().get("QuantFusionPass", 0)
    fusion_pass(gm.graph)
    gm.recompile()
    found = targets(gm)
    assert fusion_pass.matched_count == 2 and get_match_table()["QuantFusionPass"] == before + 2
    assert sorted(str(t) for t in found if t in FUSED_OPS) == ["latentspeed.add_rms_norm_group_quant.default",
                                                               "latentspeed.rms_norm_group_quant.default"]
    assert sum(t in NORM_OPS for t in found) == 1 and sum(t == LINEAR for t in found) == 1  # the router's norm
    fp8_guard("cpu").counters.zero_()
    got = gm(*args)
    assert fp8_guard("cpu").counters.tolist() == [0, 0]
    assert torch.equal(got[1], expected[1]), "the residual is x + residual, rounded once"
    assert_close(got[0], expected[0], atol=2e-2, rtol=2e-2, name="fused against unfused")
    assert got[0].dtype == dtype


def test_fused_path_counts_nonfinite_activations():
    args = list(inputs(torch.bfloat16))
    args[0][2, 3] = float("nan")
    gm = make_fx(decoder_slice, tracing_mode="fake")(*args)
    fusion.QuantFusionPass(compiling_config())(gm.graph)
    gm.recompile()
    assert any(t in FUSED_OPS for t in targets(gm))
    assert_counts_nonfinite(gm, args)


def test_pass_leaves_other_epsilons_and_wide_rows():
    x, w = torch.randn(3, 256).bfloat16(), torch.ones(256).bfloat16()
    w_fp8, s = weights(128, 256, 3)
    gm = make_fx(lambda x, w, wf, s: torch.ops.latentspeed.block_fp8_linear(vllm.ir.ops.rms_norm(x, w, 1e-3), wf, s),
                 tracing_mode="fake")(
        x, w, w_fp8, s)
    fusion_pass = fusion.QuantFusionPass(compiling_config())
    fusion_pass(gm.graph)
    assert fusion_pass.matched_count == 0 and not any(t in FUSED_OPS for t in targets(gm))


def test_install_takes_the_post_grad_slot_unless_turned_off(monkeypatch):
    config = compiling_config()
    key = "post_grad_custom_post_pass"
    monkeypatch.setenv(fusion.NORM_ENV, "0")
    monkeypatch.setenv(fusion.SILU_ENV, "0")
    assert not fusion.install(config) and key not in config.compilation_config.inductor_compile_config
    monkeypatch.setenv(fusion.NORM_ENV, "yes")
    with pytest.raises(ValueError, match="LATENTSPEED_FUSE_NORM_QUANT='yes'"):
        fusion.install(config)
    monkeypatch.delenv(fusion.NORM_ENV)
    monkeypatch.delenv(fusion.SILU_ENV)  # the default: both fused
    assert fusion.install(config) and fusion.install(config)
    installed = config.compilation_config.inductor_compile_config[key]
    assert isinstance(installed, fusion.QuantFusionPass) and (installed.norm, installed.silu_mul) == (True, True)
    monkeypatch.setenv(fusion.NORM_ENV, "0")
    silu_only = compiling_config()
    assert fusion.install(silu_only)
    installed_silu = silu_only.compilation_config.inductor_compile_config[key]
    assert (installed_silu.norm, installed_silu.silu_mul) == (False, True)
    assert installed_silu.uuid() != installed.uuid(), "vLLM's compile cache must tell the two apart"
    monkeypatch.delenv(fusion.NORM_ENV)
    eager = compiling_config(CompilationMode.NONE)
    assert not fusion.install(eager)
    taken = compiling_config()  # a pass of the user's own stays
    taken.compilation_config.inductor_compile_config[key] = users_pass = object()
    assert not fusion.install(taken) and taken.compilation_config.inductor_compile_config[key] is users_pass
    # what the fp8 warm-up compiles the producers for
    assert [fusion.fused_producers(c) for c in (config, silu_only, eager, taken)] == [
        (True, True), (False, True), (False, False), (False, False)]


def linear_as_vllm_calls_it(x, w, w_scale):
    """vLLM's block-scaled linear kernel around latentspeed's op: its input viewed as 2-D."""
    out = torch.ops.latentspeed.block_fp8_linear(x.view(-1, x.shape[-1]), w, w_scale)
    return out.view(*x.shape[:-1], w.shape[0])


def test_pass_in_inductors_post_grad_slot():
    """The pass where vLLM puts it, Inductor's post-grad custom pass, on a graph Inductor built with
    dynamic token counts (the 2-D views are no-ops Inductor removes first): both norms fused, and
    the compiled function's output equals the eager unfused one."""

    def layer(x, residual, w_in, w_a, s_a, w_q, w_b, s_b, w_gate):
        h, residual = vllm.ir.ops.fused_add_rms_norm(x, residual, w_in, 1e-6)
        q = vllm.ir.ops.rms_norm(linear_as_vllm_calls_it(h, w_a, s_a), w_q, 1e-6)
        return linear_as_vllm_calls_it(q, w_b, s_b), residual

    args = inputs(torch.bfloat16)
    expected = layer(*args)
    before = get_match_table().get("QuantFusionPass", 0)
    torch._dynamo.reset()
    fusion_pass = fusion.QuantFusionPass(compiling_config())
    with (torch._inductor.config.patch(post_grad_custom_post_pass=fusion_pass, fx_graph_cache=False),
          torch._functorch.config.patch(enable_autograd_cache=False)):  # a cached graph would skip the pass
        got = torch.compile(layer, backend="inductor", fullgraph=True, dynamic=True)(*args)
    torch._dynamo.reset()
    assert get_match_table()["QuantFusionPass"] == before + 2
    assert torch.equal(got[1], expected[1])
    assert_close(got[0], expected[0], atol=2e-2, rtol=2e-2, name="compiled fused against eager unfused")


def mlp(x, w_gate_up, s_gate_up, w_down, s_down, w_probe):
    """DeepSeek-V3's dense MLP and shared expert: gate_up_proj, SiLU-and-mul, down_proj; then a
    second SiLU-and-mul of the same width whose output also feeds a bf16 product (not fusable)."""
    y = torch.ops.latentspeed.block_fp8_linear(SiluAndMul.forward_native(
        torch.ops.latentspeed.block_fp8_linear(x, w_gate_up, s_gate_up)), w_down, s_down)
    act = SiluAndMul.forward_native(torch.ops.latentspeed.block_fp8_linear(y, w_gate_up, s_gate_up))
    return torch.ops.latentspeed.block_fp8_linear(act, w_down, s_down) + act @ w_probe


def mlp_inputs(dtype, inter=320):
    """A ragged intermediate width (320: the last quantization group holds 64 columns)."""
    gen = torch.Generator().manual_seed(4)
    hidden = 256
    w_gate_up, s_gate_up = weights(2 * inter, hidden, 5)
    w_down, s_down = weights(hidden, inter, 6)
    return (torch.randn(7, hidden, generator=gen).to(dtype), w_gate_up, s_gate_up, w_down, s_down,
            torch.randn(inter, hidden, generator=gen).to(dtype) / 16)


def decomposed_graph(fn, args):
    """``fn`` traced with Inductor's decompositions, as its post-grad graphs hold SiLU."""
    return make_fx(fn, decomposition_table=select_decomp_table(), tracing_mode="fake")(*args)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_pass_fuses_the_silu_mul_that_feeds_only_a_linear(dtype):
    args = mlp_inputs(dtype)
    gm = decomposed_graph(mlp, args)
    expected = gm(*args)
    fusion_pass = fusion.QuantFusionPass(compiling_config(), norm=False, silu_mul=True)
    fusion_pass(gm.graph)
    gm.recompile()
    found = targets(gm)
    assert fusion_pass.matched_count == 1 and fusion_pass.gate_widths == {320}
    assert sum(t == SILU_QUANT for t in found) == 1 and sum(t == LINEAR for t in found) == 3  # the probed one stays
    fp8_guard("cpu").counters.zero_()
    got = gm(*args)
    assert fp8_guard("cpu").counters.tolist() == [0, 0]
    assert_close(got, expected, atol=2e-2, rtol=2e-2, name="fused against unfused")
    assert got.dtype == dtype


def test_silu_mul_is_left_unless_turned_on_and_counts_nonfinite_values():
    args = list(mlp_inputs(torch.bfloat16))
    gm = decomposed_graph(mlp, args)
    norms_only = fusion.QuantFusionPass(compiling_config())
    norms_only(gm.graph)
    assert norms_only.matched_count == 0 and SILU_QUANT not in targets(gm)
    fusion.QuantFusionPass(compiling_config(), norm=False, silu_mul=True)(gm.graph)
    gm.recompile()
    args[0][3, 5] = float("nan")
    assert_counts_nonfinite(gm, args)


def test_silu_mul_pass_in_inductors_post_grad_slot():
    """SiLU-and-mul as Inductor decomposes it (fp32 ``x / (1 + exp(-x))``), with the token count
    dynamic and the widths static as in vLLM: fused, and equal to the eager unfused function."""
    args = mlp_inputs(torch.bfloat16, inter=256)
    expected = mlp(*args)
    torch._dynamo.reset()
    fusion_pass = fusion.QuantFusionPass(compiling_config(), norm=False, silu_mul=True)
    torch._dynamo.mark_dynamic(args[0], 0)
    with (torch._inductor.config.patch(post_grad_custom_post_pass=fusion_pass, fx_graph_cache=False),
          torch._functorch.config.patch(enable_autograd_cache=False)):
        got = torch.compile(mlp, backend="inductor", fullgraph=True)(*args)
    torch._dynamo.reset()
    assert fusion_pass.matched_count == 1 and fusion_pass.gate_widths == {256}
    assert_close(got, expected, atol=2e-2, rtol=2e-2, name="compiled fused against eager unfused")
