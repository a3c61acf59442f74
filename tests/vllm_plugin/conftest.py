"""Wiring tests against the real vLLM 0.26.0 on a CPU-only machine.

vLLM resolves its platform during ``import vllm``; without a GPU that is the Unspecified
platform, which cannot select attention backends. These tests import every vLLM module they
need first, then install ``FakeHopperPlatform``: vLLM's own ``CudaPlatformBase`` with the
device queries answered for an H200 (and for older chips where a test asks), so vLLM's real
selection and validation code runs. ``vllm/platforms/cuda.py`` loads a native extension that
needs ``libcuda.so.1``; where the driver is absent an empty module stands in for it (it only
registers custom ops, which no test here calls).
"""

import importlib
import json
import sys
import tempfile
import types

import pytest
import torch

vllm = pytest.importorskip("vllm")

import vllm.model_executor.layers.attention.mla_attention  # noqa: E402,F401
import vllm.model_executor.model_loader  # noqa: E402,F401  (ModelConfig inspects the model with it)
import vllm.model_executor.models.deepseek_v2  # noqa: E402,F401
import vllm.platforms as vllm_platforms  # noqa: E402

import vllm_plugin.mla  # noqa: E402,F401
import vllm_plugin.mla_prefill  # noqa: E402,F401

try:
    importlib.import_module("vllm._C_stable_libtorch")
except ImportError:
    sys.modules["vllm._C_stable_libtorch"] = types.ModuleType("vllm._C_stable_libtorch")

from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.distributed import (  # noqa: E402
    cleanup_dist_env_and_memory,
    init_distributed_environment,
    initialize_model_parallel,
)
from vllm.platforms.cuda import CudaPlatformBase  # noqa: E402
from vllm.platforms.interface import DeviceCapability  # noqa: E402
from vllm.utils.torch_utils import set_default_torch_dtype  # noqa: E402

import vllm_plugin  # noqa: E402
from tests.vllm_plugin.test_wiring import TINY_DEEPSEEK_V3  # noqa: E402
from vllm_plugin.fp8 import NAME  # noqa: E402


class FakeHopperPlatform(CudaPlatformBase):
    capability = DeviceCapability(9, 0)

    @classmethod
    def get_device_capability(cls, device_id: int = 0) -> DeviceCapability:
        return cls.capability

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return "NVIDIA H200 (test platform)"

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        return 141 << 30

    @classmethod
    def is_fully_connected(cls, physical_device_ids) -> bool:
        return False

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        return False

    @classmethod
    def device_count(cls) -> int:
        return 1

    @classmethod
    def num_compute_units(cls, device_id: int = 0) -> int:
        return 132


@pytest.fixture
def hopper(monkeypatch):
    """vLLM's current platform is a CUDA platform reporting an H200 for the test's duration."""
    from vllm.utils.platform_utils import is_pin_memory_available
    from vllm.v1.attention.selector import _cached_get_attn_backend

    monkeypatch.setattr(vllm_platforms, "_current_platform", FakeHopperPlatform())
    is_pin_memory_available.cache_clear()
    _cached_get_attn_backend.cache_clear()
    yield FakeHopperPlatform
    FakeHopperPlatform.capability = DeviceCapability(9, 0)
    _cached_get_attn_backend.cache_clear()
    is_pin_memory_available.cache_clear()


# --quantization latentspeed_fp8: a vLLM config of the tiny DeepSeek-V3 and a tensor-parallel group of one.
DEEPSEEK_FP8 = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic", "fmt": "e4m3"}


@pytest.fixture
def hopper_quant(hopper, monkeypatch):
    """A CUDA platform that lists latentspeed_fp8, as registration does on a real CUDA platform."""
    vllm_plugin.register()
    monkeypatch.setattr(CudaPlatformBase, "supported_quantization", [*CudaPlatformBase.supported_quantization, NAME])
    return hopper


def model_config(tmp_path, quant_cfg=None, quantization=NAME) -> ModelConfig:
    config = dict(TINY_DEEPSEEK_V3, **({"quantization_config": quant_cfg} if quant_cfg else {}))
    (tmp_path / "config.json").write_text(json.dumps(config))
    return ModelConfig(model=str(tmp_path), skip_tokenizer_init=True, dtype="bfloat16", quantization=quantization)


@pytest.fixture
def tp_group(hopper_quant, tmp_path):
    """A current vLLM config and a tensor-parallel group of one (gloo)."""
    config = VllmConfig(model_config=model_config(tmp_path, DEEPSEEK_FP8))
    with set_current_vllm_config(config), set_default_torch_dtype(torch.bfloat16):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"file://{tempfile.mkstemp()[1]}")
        initialize_model_parallel(1, 1)
        yield config
        cleanup_dist_env_and_memory()


