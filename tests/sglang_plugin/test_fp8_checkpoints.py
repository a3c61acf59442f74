"""Whole tiny DeepSeek-V3 checkpoints, in each format ``latentspeed_fp8`` loads, through SGLang
0.5.17's own ``get_model`` on the CPU: SGLang's loader reads the safetensors file, its DeepSeek-V3
maps the names (fused ``q_a``/``kv_a``, gate and up, experts), latentspeed's methods and schemes
receive every tensor, and ``post_load_weights`` dequantizes ``kv_b_proj`` into ``w_kc``/``w_vc`` for
weight absorption. Bad checkpoints stop the load by name.

SGLang takes this machine for a GPU one without a GPU, so three of its module flags are set as on
an sm_90 GPU host: the device capability (latentspeed_fp8 checks it), ``_is_cuda`` of the DeepSeek
weight loader (its CUDA path dequantizes ``kv_b_proj``) and ``_is_cpu`` of the rotary embedding
(the CUDA one needs a GPU). SGLang's CPU rotary factory takes scaled rope only, so the checkpoints
carry DeepSeek-V3's own yarn ``rope_scaling``."""

import contextlib
import tempfile

import pytest
import torch

pytest.importorskip("sglang")

import sglang.srt.layers.rotary_embedding.base as rotary_base  # noqa: E402
import sglang.srt.models.deepseek_common.deepseek_weight_loader as deepseek_weight_loader  # noqa: E402
from sglang.srt import runtime_context  # noqa: E402
from sglang.srt.configs.device_config import DeviceConfig  # noqa: E402
from sglang.srt.configs.load_config import LoadConfig  # noqa: E402
from sglang.srt.configs.model_config import ModelConfig  # noqa: E402
from sglang.srt.distributed import init_distributed_environment, initialize_model_parallel  # noqa: E402
from sglang.srt.distributed.parallel_state import cleanup_dist_env_and_memory  # noqa: E402
from sglang.srt.layers.dp_attention import initialize_dp_attention  # noqa: E402
from sglang.srt.layers.linear import LinearBase  # noqa: E402
from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE  # noqa: E402
from sglang.srt.model_loader import get_model  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402

import sglang_plugin  # noqa: E402
from sglang_plugin.fp8 import (  # noqa: E402
    NAME,
    LatentspeedCTW8A8Fp8,
    LatentspeedCTW8A8Fp8MoE,
    LatentspeedFp8LinearMethod,
    LatentspeedFp8MoEMethod,
)
from tests.helpers import assert_close  # noqa: E402
from tests.tiny_checkpoints import CONFIG, FLAWS, FORMATS, bf16_tensors, dequantized, write_checkpoint  # noqa: E402
from tests.tiny_checkpoints import assert_loaded_as_written, assert_unquantized_kept, write_bad_checkpoint  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU load stands in for a GPU host")

YARN = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0}
CHECKPOINT_CONFIG = dict(CONFIG, rope_scaling=YARN)
SCALE_NAMES = {"deepseek_fp8": "weight_scale_inv", "compressed_tensors": "weight_scale", "bf16": "weight_scale_inv"}


@contextlib.contextmanager
def loaded(path):
    """SGLang's model load as its model runner does it, with a tensor-parallel group of one (gloo)
    that lives until the block ends (the model's parallel layers need it to run)."""
    args = ServerArgs(model_path=str(path), skip_tokenizer_init=True, device="cpu", dtype="bfloat16",
                      quantization=NAME)
    runtime_context.publish(args, role="test")
    model_config = ModelConfig.from_server_args(args)
    init_distributed_environment(backend="gloo", world_size=1, rank=0, local_rank=0,
                                 distributed_init_method=f"file://{tempfile.mkstemp()[1]}")
    try:
        initialize_model_parallel(tensor_model_parallel_size=1)
        initialize_dp_attention(server_args=args, model_config=model_config)
        yield get_model(model_config=model_config, load_config=LoadConfig(), device_config=DeviceConfig("cpu"))
    finally:
        cleanup_dist_env_and_memory()


def load(path):
    with loaded(path) as model:
        return model


@pytest.fixture
def gpu_host(monkeypatch):
    sglang_plugin.register()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(rotary_base, "_is_cpu", True)
    monkeypatch.setattr(deepseek_weight_loader, "_is_cuda", True)


def methods(model) -> set[str]:
    """The quantization methods of the linear and MoE layers, by scheme where compressed-tensors has one."""
    found = set()
    for module in model.modules():
        if isinstance(module, (LinearBase, FusedMoE)) and module.quant_method is not None:
            scheme = getattr(module, "scheme", None)
            found.add(type(scheme if scheme is not None else module.quant_method).__name__)
    return found


EXPECTED = {
    "deepseek_fp8": {LatentspeedFp8LinearMethod.__name__, LatentspeedFp8MoEMethod.__name__},
    "compressed_tensors": {LatentspeedCTW8A8Fp8.__name__, LatentspeedCTW8A8Fp8MoE.__name__},
    "bf16": {LatentspeedFp8LinearMethod.__name__, LatentspeedFp8MoEMethod.__name__},
}


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_each_format_loads_through_sglangs_model_loader(gpu_host, tmp_path, fmt):
    original = bf16_tensors()
    written = write_checkpoint(tmp_path, fmt, original, CHECKPOINT_CONFIG)

    model = load(tmp_path)

    assert EXPECTED[fmt] <= methods(model)
    params = dict(model.named_parameters())
    scale_name = SCALE_NAMES[fmt]
    assert_loaded_as_written(params, written, original, fmt, scale_name, "self_attn.fused_qkv_a_proj_with_mqa",
                             "mlp.experts")
    # Weight absorption: w_kc and w_vc are kv_b_proj's key and value rows per head, dequantized. SGLang
    # absorbs before any process_weights_after_loading, so from a bf16 checkpoint they are its bf16
    # rows (as under SGLang's own fp8), while the kv_b_proj layer (prefill) holds them quantized.
    c = CONFIG
    attention = "model.layers.1.self_attn"
    if fmt == "bf16":
        kv_b = original[f"{attention}.kv_b_proj.weight"].float()
    else:
        kv_b = dequantized(params[f"{attention}.kv_b_proj.weight"], params[f"{attention}.kv_b_proj.{scale_name}"])
    keys, values = kv_b.view(c["num_attention_heads"], -1, c["kv_lora_rank"]).split(
        [c["qk_nope_head_dim"], c["v_head_dim"]], dim=1)
    absorbed = model.get_submodule(attention)
    assert_close(absorbed.w_kc.float(), keys, atol=1e-6, rtol=1e-2, name="w_kc")
    assert_close(absorbed.w_vc.float(), values.transpose(1, 2), atol=1e-6, rtol=1e-2, name="w_vc")


@pytest.mark.parametrize("flaw", FLAWS)
@pytest.mark.parametrize("fmt", ["deepseek_fp8", "compressed_tensors"])
def test_a_flawed_checkpoint_stops_the_load_by_name(gpu_host, tmp_path, fmt, flaw):
    """A bf16 tensor under an FP8 config, or a missing scale."""
    write_bad_checkpoint(tmp_path, fmt, flaw, CHECKPOINT_CONFIG)
    with pytest.raises(ValueError, match=FLAWS[flaw]):
        load(tmp_path)


def test_unquantized_tensors_stay_bf16(gpu_host, tmp_path):
    written = write_checkpoint(tmp_path, "deepseek_fp8", config=CHECKPOINT_CONFIG)
    params = dict(load(tmp_path).named_parameters())
    assert_unquantized_kept(params, written)
