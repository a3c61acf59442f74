"""The producer fusion of ``sglang_plugin/fusion.py`` in a tiny DeepSeek-V3 loaded by SGLang 0.5.17's
own ``get_model`` on the CPU (``test_fp8_checkpoints.loaded``), run through SGLang's own module
methods: the fused norms and activation hand their consumers the fp8 values and scales that
latentspeed's reference quantization gives (so the consumers' outputs are those of the GEMM on those
operands, bit for bit), and stay within fp8 rounding of SGLang's unfused modules.

Tolerances: a fused producer's dequantized output against SGLang's own bf16 one, ``2^-4`` relative
(half an E4M3 step) plus ``2^-7`` (SGLang's CPU norm and activation round in bf16 where the
kernels keep fp32); consumer outputs, fused against unfused, 3 % relative RMS (fp8 rounding of
inputs that differ by a bf16 ulp)."""

import types

import pytest
import torch

pytest.importorskip("sglang")

from sglang.srt.layers.activation import SiluAndMul  # noqa: E402
from sglang.srt.layers.layernorm import RMSNorm  # noqa: E402

from common_kernels.fp8 import SCALE_BLOCK, block_scaled_gemm  # noqa: E402
from common_kernels.fp8.reference import rms_norm_group_quant_ref, silu_mul_group_quant_ref  # noqa: E402
from sglang_plugin import fusion  # noqa: E402
from sglang_plugin.fusion import FusedRMSNormQuant, FusedSiluMulQuant, after_load_model, fuse_producers  # noqa: E402
from tests.helpers import assert_close  # noqa: E402
from tests.sglang_plugin.test_fp8_checkpoints import CHECKPOINT_CONFIG, gpu_host, load, loaded  # noqa: E402,F401
from tests.tiny_checkpoints import CONFIG, write_checkpoint  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU load stands in for a GPU host")
TOKENS = 5


def dequantized(q, scales):
    return q.float() * scales.repeat_interleave(SCALE_BLOCK, 1)[:, :q.shape[1]]


def rel_rms(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.fixture(params=["deepseek_fp8", "compressed_tensors"])
def model(request, gpu_host, tmp_path):  # noqa: F811
    """The tiny DeepSeek-V3 in DeepSeek's own FP8 format (``Fp8LinearMethod``) or as llm-compressor
    writes it (the compressed-tensors scheme): both hand a tuple input to latentspeed's GEMM."""
    write_checkpoint(tmp_path, request.param, config=CHECKPOINT_CONFIG)
    with loaded(tmp_path) as model:
        yield model


def test_fusable_producers_get_their_fused_class(model):
    layers = model.model.layers
    assert fuse_producers(model, norm=True, silu_mul=True) == 2 * len(layers) + 2  # + the dense MLP, the shared expert
    for layer in layers:
        assert type(layer.input_layernorm) is FusedRMSNormQuant
        assert type(layer.self_attn.q_a_layernorm) is FusedRMSNormQuant
        # its output feeds the KV cache, and the MLP reads its input's shape / the router reads it
        assert type(layer.self_attn.kv_a_layernorm) is RMSNorm
        assert type(layer.post_attention_layernorm) is RMSNorm
    assert type(layers[0].mlp.act_fn) is FusedSiluMulQuant
    assert type(layers[1].mlp.shared_experts.act_fn) is FusedSiluMulQuant
    assert layers[0].layer_communicator.input_layernorm is layers[0].input_layernorm  # the communicator's too


def test_fused_norms_feed_their_linear_layers(model):
    attn = model.model.layers[1].self_attn
    norm = model.model.layers[1].input_layernorm
    x = torch.randn(TOKENS, CONFIG["hidden_size"], dtype=torch.bfloat16)
    residual = torch.randn_like(x)
    q_lora = torch.randn(TOKENS, CONFIG["q_lora_rank"], dtype=torch.bfloat16) * 3
    native, native_residual = norm.forward_native(x.clone(), residual.clone())
    unfused_latent = attn.prepare_qkv_latent(native, None)
    unfused_q = attn.q_b_proj_forward(attn.q_a_layernorm.forward_native(q_lora.clone()))

    fuse_producers(model, norm=True, silu_mul=False)
    (q, scales), residual_out = norm(x, residual)
    ref_q, ref_scales, ref_residual = rms_norm_group_quant_ref(x, norm.weight, norm.variance_epsilon, residual)
    assert torch.equal(q.float(), ref_q.float()) and torch.equal(scales, ref_scales)
    assert torch.equal(residual_out, ref_residual)
    assert_close(residual_out, native_residual, atol=0, rtol=2**-8, name="residual")
    assert_close(dequantized(q, scales), native, atol=1e-3, rtol=2**-4 + 2**-7, name="fused input_layernorm")

    latent = attn.prepare_qkv_latent((q, scales), None)
    proj = attn.fused_qkv_a_proj_with_mqa
    weight_scale = getattr(proj, "weight_scale_inv", None)
    weight_scale = proj.weight_scale if weight_scale is None else weight_scale
    assert torch.equal(latent, block_scaled_gemm(q, scales, proj.weight, weight_scale.float()))
    assert rel_rms(latent, unfused_latent) < 0.03

    fused_q = attn.q_b_proj_forward(attn.q_a_layernorm(q_lora))
    assert fused_q.shape == unfused_q.shape
    assert rel_rms(fused_q, unfused_q) < 0.03


def test_fused_activation_feeds_down_proj(model):
    mlp = model.model.layers[0].mlp
    x = torch.randn(TOKENS, CONFIG["hidden_size"], dtype=torch.bfloat16)
    gate_up = torch.randn(TOKENS, 2 * CONFIG["intermediate_size"], dtype=torch.bfloat16) * 2
    unfused = mlp(x)
    native = SiluAndMul.forward_native(mlp.act_fn, gate_up)

    fuse_producers(model, norm=False, silu_mul=True)
    q, scales = mlp.act_fn(gate_up)
    ref_q, ref_scales = silu_mul_group_quant_ref(gate_up)
    assert torch.equal(q.float(), ref_q.float()) and torch.equal(scales, ref_scales)
    assert_close(dequantized(q, scales), native, atol=1e-3, rtol=2**-4 + 2**-7, name="fused SiLU-and-mul")
    assert rel_rms(mlp(x), unfused) < 0.03  # SGLang's own DeepseekV2MLP.forward, down_proj on the tuple


def test_batches_the_kernels_do_not_take_run_unfused(model):
    fuse_producers(model, norm=True, silu_mul=True)
    norm = model.model.layers[0].input_layernorm
    empty = torch.empty(0, CONFIG["hidden_size"], dtype=torch.bfloat16)
    assert isinstance(norm(empty), torch.Tensor)
    wide = torch.randn(2, 3, CONFIG["hidden_size"], dtype=torch.bfloat16)
    assert norm(wide).shape == wide.shape


def runner(model, **server_args):
    defaults = dict(enable_torch_compile=False, tp_size=1, enable_dp_attention=False, dcp_size=1,
                    enable_deterministic_inference=False)
    return types.SimpleNamespace(model=model, server_args=types.SimpleNamespace(**{**defaults, **server_args}))


def test_the_load_hook_follows_the_switches(model, monkeypatch, caplog):
    monkeypatch.delenv(fusion.NORM_ENV, raising=False)
    monkeypatch.delenv(fusion.SILU_ENV, raising=False)
    after_load_model(None, runner(model))  # off by default in SGLang
    assert type(model.model.layers[0].input_layernorm) is RMSNorm

    monkeypatch.setenv(fusion.NORM_ENV, "1")
    after_load_model(None, runner(model, enable_torch_compile=True))
    assert type(model.model.layers[0].input_layernorm) is RMSNorm
    assert "--enable-torch-compile" in caplog.text
    after_load_model(None, runner(model, tp_size=2))
    assert type(model.model.layers[0].input_layernorm) is RMSNorm

    after_load_model(None, runner(model))
    assert type(model.model.layers[0].input_layernorm) is FusedRMSNormQuant
    assert type(model.model.layers[0].mlp.act_fn) is SiluAndMul  # SiLU-and-mul has its own switch

    monkeypatch.setenv(fusion.SILU_ENV, "yes")
    with pytest.raises(ValueError, match="LATENTSPEED_FUSE_SILU_QUANT='yes'"):
        after_load_model(None, runner(model))
