"""latentspeed's vLLM adapter against vLLM 0.26.0's own registries and selectors."""

import importlib.metadata
import io
import json
import logging

import pytest
import torch
from vllm.config import AttentionConfig, CacheConfig, ModelConfig, VllmConfig, set_current_vllm_config
from vllm.platforms.interface import DeviceCapability
from vllm.v1.attention.backends.mla.prefill import MLAPrefillBackendEnum, get_mla_prefill_backend
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.attention.selector import get_attn_backend

import vllm_plugin
from vllm_plugin import _compat
from vllm_plugin.mla import LatentspeedMLABackend, LatentspeedMLAImpl, LatentspeedMLAMetadataBuilder
from vllm_plugin.mla_prefill import LatentspeedMLAPrefill

TINY_DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "q_lora_rank": 128,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "vocab_size": 1024,
    "max_position_embeddings": 4096,
    "torch_dtype": "bfloat16",
}


@pytest.fixture(autouse=True)
def registered():
    vllm_plugin.register()
    yield


def model_dir(tmp_path, **overrides):
    (tmp_path / "config.json").write_text(json.dumps({**TINY_DEEPSEEK_V3, **overrides}))
    return str(tmp_path)


def engine_config(tmp_path, kv_cache_dtype="auto", block_size=None, prefill=None, **model_overrides):
    model = ModelConfig(model=model_dir(tmp_path, **model_overrides), skip_tokenizer_init=True, dtype="bfloat16")
    cache = CacheConfig(cache_dtype=kv_cache_dtype)
    if block_size is not None:
        cache.block_size = block_size
        cache.user_specified_block_size = True
    attention = AttentionConfig(backend="CUSTOM", mla_prefill_backend=prefill)
    return VllmConfig(model_config=model, cache_config=cache, attention_config=attention)


def select(config: VllmConfig):
    with set_current_vllm_config(config):
        return get_attn_backend(
            576, torch.bfloat16, config.cache_config.cache_dtype, use_mla=True, num_heads=16
        )


def test_entry_point_is_discovered():
    from vllm.plugins import load_plugins_by_group

    names = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="vllm.general_plugins")}
    assert names.get("latentspeed") == "vllm_plugin:register"
    assert load_plugins_by_group("vllm.general_plugins")["latentspeed"] is vllm_plugin.register


def test_register_twice_is_harmless():
    vllm_plugin.register()
    vllm_plugin.register()
    assert AttentionBackendEnum.CUSTOM.get_class() is LatentspeedMLABackend
    assert MLAPrefillBackendEnum.CUSTOM.get_class() is LatentspeedMLAPrefill
    assert LatentspeedMLABackend.get_impl_cls() is LatentspeedMLAImpl
    assert LatentspeedMLABackend.get_builder_cls() is LatentspeedMLAMetadataBuilder


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"])
def test_custom_backend_is_selected(hopper, tmp_path, kv_cache_dtype):
    assert select(engine_config(tmp_path, kv_cache_dtype)) is LatentspeedMLABackend


@pytest.mark.parametrize("block_size", [16, 32, 64])
def test_advertised_block_sizes_are_accepted(hopper, tmp_path, block_size):
    assert select(engine_config(tmp_path, block_size=block_size)) is LatentspeedMLABackend


@pytest.mark.parametrize(
    "kwargs, reason",
    [
        ({"kv_cache_dtype": "fp8_ds_mla"}, "kv_cache_dtype not supported"),
        ({"block_size": 128}, "latentspeed: block size 128 is not supported"),
        ({"kv_lora_rank": 384}, "latentspeed: kv_lora_rank=384 is not supported"),
        ({"qk_rope_head_dim": 48}, "latentspeed: qk_rope_head_dim=48 is not supported"),
        ({"qk_nope_head_dim": 100}, "latentspeed: prefill: head size 164 is not supported"),
        ({"v_head_dim": 96}, "latentspeed: v_head_dim=96 is not supported"),
    ],
    ids=["ds_mla_cache", "block128", "kv_lora_rank", "rope_dim", "qk_head_dim", "v_head_dim"],
)
def test_unsupported_configurations_are_refused(hopper, tmp_path, kwargs, reason):
    with pytest.raises(ValueError, match="Selected backend AttentionBackendEnum.CUSTOM is not valid") as err:
        select(engine_config(tmp_path, **kwargs))
    assert reason in str(err.value)


@pytest.mark.parametrize(
    "capability, kv_cache_dtype, reason",
    [
        (DeviceCapability(7, 5), "auto", "compute capability not supported"),
        (DeviceCapability(8, 0), "fp8_e5m2", "an fp8 kv-cache needs compute capability 8.9 or newer"),
    ],
    ids=["turing", "ampere_fp8"],
)
def test_old_gpus_are_refused(hopper, tmp_path, capability, kv_cache_dtype, reason):
    hopper.capability = capability
    with pytest.raises(ValueError) as err:
        select(engine_config(tmp_path, kv_cache_dtype))
    assert reason in str(err.value)


def test_custom_prefill_backend_is_selected(hopper, tmp_path):
    assert get_mla_prefill_backend(engine_config(tmp_path, prefill="CUSTOM")) is LatentspeedMLAPrefill


def test_prefill_backend_refuses_unsupported_head_dims(hopper, tmp_path):
    with pytest.raises(ValueError, match="Selected MLA prefill backend CUSTOM is not valid"):
        get_mla_prefill_backend(engine_config(tmp_path, prefill="CUSTOM", qk_nope_head_dim=100))


def test_unsupported_vllm_version_is_named(monkeypatch):
    monkeypatch.setattr(_compat, "version", lambda name: "0.25.1")
    with pytest.raises(_compat.UnsupportedVllmError, match="supports vLLM 0.26.x; found vLLM 0.25.1"):
        _compat.check_vllm()


def test_missing_vllm_is_named(monkeypatch):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(_compat, "version", not_installed)
    with pytest.raises(_compat.UnsupportedVllmError, match="vLLM is not installed"):
        _compat.check_vllm()


@pytest.fixture
def fresh_latentspeed_logger(monkeypatch):
    ours = logging.getLogger("latentspeed")
    monkeypatch.setattr(ours, "handlers", [])
    monkeypatch.setattr(ours, "level", logging.NOTSET)
    monkeypatch.setattr(ours, "propagate", True)
    return ours


def test_our_info_lines_go_through_vllms_handlers(fresh_latentspeed_logger, monkeypatch):
    theirs, stream = logging.getLogger("vllm"), io.StringIO()
    assert theirs.handlers, "vLLM configures its logger when imported"
    monkeypatch.setattr(theirs, "handlers", [logging.StreamHandler(stream)])  # the handler of this vLLM's config
    monkeypatch.setattr(theirs, "level", logging.INFO)  # VLLM_LOGGING_LEVEL's default
    vllm_plugin.log_through_vllm()
    fresh_latentspeed_logger.info("latentspeed: a layer warmed up for 1-%d tokens", 8)
    fresh_latentspeed_logger.debug("not at INFO")
    assert "latentspeed: a layer warmed up for 1-8 tokens" in stream.getvalue()
    assert "not at INFO" not in stream.getvalue() and not fresh_latentspeed_logger.propagate


def test_a_users_logging_setup_is_left_alone(fresh_latentspeed_logger):
    own = logging.StreamHandler()
    fresh_latentspeed_logger.addHandler(own)
    vllm_plugin.log_through_vllm()
    assert fresh_latentspeed_logger.handlers == [own] and fresh_latentspeed_logger.propagate


def test_gpu_e2e_engines_are_vllm_arguments(monkeypatch):
    """``tests/gpu/vllm_e2e.py``'s engines are vLLM engine arguments with backends, cache dtypes and quantization
    methods vLLM knows, and its pairs and environments name known engines: a wrong name fails here, not after
    minutes on the GPU host."""
    import dataclasses
    import typing
    from pathlib import Path

    from vllm.config.cache import CacheDType
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "gpu"))
    import vllm_e2e

    for engine in vllm_e2e.ENGINES:
        kwargs = vllm_e2e.llm_kwargs("/models/tiny-dsv3", engine, 17_000)
        assert set(kwargs) <= {f.name for f in dataclasses.fields(EngineArgs)}, engine
        AttentionConfig(**kwargs["attention_config"])  # unknown backend names raise
        assert kwargs["kv_cache_dtype"] in typing.get_args(CacheDType), engine
        assert kwargs["quantization"] in (None, *QUANTIZATION_METHODS), engine
    paired = {engine for pairs in vllm_e2e.PAIRS.values() for pair in pairs for engine in pair}
    assert paired | set(vllm_e2e.ENGINE_ENV) <= set(vllm_e2e.ENGINES)
