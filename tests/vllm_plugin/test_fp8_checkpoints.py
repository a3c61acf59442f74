"""Whole tiny DeepSeek-V3 checkpoints, in each format ``latentspeed_fp8`` loads, through vLLM
0.26.0's own model loader on the CPU: ``DefaultModelLoader`` reads the safetensors files, the
DeepSeek-V3 model maps the names (fused ``q_a``/``kv_a``, gate and up, experts), latentspeed's
methods receive every tensor, and ``process_weights_after_loading`` runs for every layer (the MLA
layers dequantize ``kv_b_proj`` for weight absorption). Bad checkpoints stop the load by name."""

import tempfile

import pytest
from vllm.config import AttentionConfig, DeviceConfig, LoadConfig, ModelConfig, VllmConfig, set_current_vllm_config
from vllm.distributed import cleanup_dist_env_and_memory, init_distributed_environment, initialize_model_parallel
from vllm.model_executor.layers.linear import LinearBase
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

from tests.helpers import assert_close
from tests.tiny_checkpoints import (
    CONFIG,
    FLAWS,
    FORMATS,
    assert_loaded_as_written,
    assert_unquantized_kept,
    bf16_tensors,
    dequantized,
    write_bad_checkpoint,
    write_checkpoint,
)
from vllm_plugin.fp8 import (
    NAME,
    LatentspeedCTFp8MoEMethod,
    LatentspeedFp8LinearMethod,
    LatentspeedFp8MoEMethod,
    LatentspeedOnlineFp8LinearMethod,
    LatentspeedOnlineFp8MoEMethod,
)

EXPECTED_METHODS = {
    "deepseek_fp8": (LatentspeedFp8LinearMethod, LatentspeedFp8MoEMethod),
    "compressed_tensors": (LatentspeedFp8LinearMethod, LatentspeedCTFp8MoEMethod),
    "bf16": (LatentspeedOnlineFp8LinearMethod, LatentspeedOnlineFp8MoEMethod),
}


def load(path):
    """vLLM's model load as an engine start runs it (eager, latentspeed's attention backends)."""
    model_config = ModelConfig(model=str(path), skip_tokenizer_init=True, dtype="bfloat16", quantization=NAME,
                               enforce_eager=True)
    config = VllmConfig(model_config=model_config, device_config=DeviceConfig("cpu"),
                        attention_config=AttentionConfig(backend="CUSTOM", mla_prefill_backend="CUSTOM"))
    with set_current_vllm_config(config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"file://{tempfile.mkstemp()[1]}")
        initialize_model_parallel(1, 1)
        try:
            return DefaultModelLoader(LoadConfig()).load_model(config, model_config)
        finally:
            cleanup_dist_env_and_memory()


@pytest.fixture
def engine(hopper_quant, monkeypatch):
    monkeypatch.setenv("VLLM_DISABLE_SHARED_EXPERTS_STREAM", "1")  # its own CUDA stream otherwise


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_each_format_loads_through_vllms_model_loader(engine, tmp_path, fmt):
    original = bf16_tensors()
    written = write_checkpoint(tmp_path, fmt, original)

    model = load(tmp_path)

    linear_method, moe_method = EXPECTED_METHODS[fmt]
    methods = {type(m.quant_method) for m in model.modules() if isinstance(m, LinearBase) and m.quant_method}
    assert linear_method in methods
    assert {type(m.quant_method) for m in model.modules() if type(m).__name__ == "RoutedExperts"} == {moe_method}
    params = dict(model.named_parameters())
    scale_name = FORMATS[fmt][0] or "weight_scale_inv"
    assert_loaded_as_written(params, written, original, fmt, scale_name, "self_attn.fused_qkv_a_proj",
                             "mlp.experts.routed_experts")
    # MLA's weight absorption dequantized kv_b_proj: W_UV holds its value rows (per head, transposed).
    c = CONFIG
    attention = "model.layers.1.self_attn"
    kv_b = dequantized(params[f"{attention}.kv_b_proj.weight"], params[f"{attention}.kv_b_proj.{scale_name}"])
    values = kv_b.view(c["num_attention_heads"], c["qk_nope_head_dim"] + c["v_head_dim"], c["kv_lora_rank"])
    assert_close(params[f"{attention}.mla_attn.mla_attn.W_UV"], values[:, c["qk_nope_head_dim"]:].transpose(1, 2),
                 atol=1e-6, rtol=1e-2, name="W_UV")


@pytest.mark.parametrize("flaw", FLAWS)
@pytest.mark.parametrize("fmt", ["deepseek_fp8", "compressed_tensors"])
def test_a_flawed_checkpoint_stops_the_load_by_name(engine, tmp_path, fmt, flaw):
    """A bf16 tensor under an FP8 config, or a missing scale."""
    write_bad_checkpoint(tmp_path, fmt, flaw)
    with pytest.raises(ValueError, match=FLAWS[flaw]):
        load(tmp_path)


def test_unquantized_tensors_stay_bf16(engine, tmp_path):
    written = write_checkpoint(tmp_path, "deepseek_fp8")
    params = dict(load(tmp_path).named_parameters())
    assert_unquantized_kept(params, written)
