"""latentspeed's SGLang adapter against SGLang 0.5.17's own plugin loader, registries and KV pool."""

import argparse
import importlib.metadata
import multiprocessing

import pytest

sglang = pytest.importorskip("sglang")

from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS  # noqa: E402
from sglang.srt.server_args import (  # noqa: E402
    ATTENTION_BACKEND_CHOICES,
    CHUNKED_PREFIX_CACHE_SUPPORTED_ATTENTION_BACKENDS,
    ServerArgs,
)

import sglang_plugin  # noqa: E402
from sglang_plugin import _compat  # noqa: E402


@pytest.fixture(autouse=True)
def registered():
    sglang_plugin.register()


def test_entry_point_is_discovered():
    eps = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="sglang.srt.plugins")}
    assert eps.get("latentspeed") == "sglang_plugin:register"


def test_register_twice_is_harmless():
    sglang_plugin.register()
    sglang_plugin.register()
    assert ATTENTION_BACKEND_CHOICES.count("latentspeed") == 1
    assert ATTENTION_BACKENDS["latentspeed"] is sglang_plugin.create_backend
    assert CHUNKED_PREFIX_CACHE_SUPPORTED_ATTENTION_BACKENDS.count("latentspeed") == 1  # MHA over long prefixes


def _load_in_child(queue):
    # What SGLang's scheduler process does first (scheduler.py: run_scheduler_process).
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, CHUNKED_PREFIX_CACHE_SUPPORTED_ATTENTION_BACKENDS

    load_plugins()
    queue.put(("latentspeed" in ATTENTION_BACKENDS, "latentspeed" in ATTENTION_BACKEND_CHOICES,
               "latentspeed" in CHUNKED_PREFIX_CACHE_SUPPORTED_ATTENTION_BACKENDS))


def test_plugin_loads_in_a_spawned_child_process():
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_load_in_child, args=(queue,))
    child.start()
    registered, choice, chunked_prefix = queue.get(timeout=300)
    child.join(timeout=60)
    assert child.exitcode == 0
    assert registered and choice and chunked_prefix


def _forward_in_child(queue):
    """A scheduler process whose model forward pass is a CPU stand-in: the hook that load_plugins
    applies around ModelRunner.forward steps latentspeed's fp8 guards after every pass."""
    import os

    os.environ["LATENTSPEED_FP8_GUARD"] = "raise"
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.plugins import load_plugins

    from common_kernels.guard import Fp8NumericsError, fp8_guard

    ModelRunner.forward = lambda self, batch: "logits"  # stands in for the GPU pass the hook wraps
    load_plugins()
    guard = fp8_guard("cpu")
    guard.check_every = 2
    outputs = [ModelRunner.forward(None, None)]
    guard.counters[1] += 1  # one non-finite activation, as a quantizer counts it
    try:
        outputs.append(ModelRunner.forward(None, None))
    except Fp8NumericsError as error:
        outputs.append(str(error))
    queue.put(outputs)


def test_fp8_guard_is_stepped_after_every_forward_pass_whatever_the_backend():
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_forward_in_child, args=(queue,))
    child.start()
    outputs = queue.get(timeout=300)
    child.join(timeout=60)
    assert child.exitcode == 0
    assert outputs[0] == "logits"
    assert "0 values clamped at the fp8 maximum and 1 non-finite" in outputs[1]


@pytest.mark.parametrize("flag", ["--attention-backend", "--decode-attention-backend", "--prefill-attention-backend"])
def test_cli_accepts_the_backend_name(flag):
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(["--model-path", "/models/tiny-dsv3", flag, "latentspeed"])
    assert getattr(args, flag.lstrip("-").replace("-", "_")) == "latentspeed"


def test_deepseek_tables_route_to_latentspeed():
    from sglang.srt.models.deepseek_common.attention_backend_handler import (
        AttentionBackendRegistry,
        handle_attention_fa3,
    )
    from sglang.srt.models.deepseek_common.utils import FORWARD_ABSORB_CORE_ATTENTION_BACKENDS

    from sglang_plugin.mla import register_deepseek_dispatch

    register_deepseek_dispatch()
    register_deepseek_dispatch()
    assert FORWARD_ABSORB_CORE_ATTENTION_BACKENDS.count("latentspeed") == 1
    assert AttentionBackendRegistry.get_handler("latentspeed") is handle_attention_fa3


def test_unsupported_sglang_version_is_named(monkeypatch):
    monkeypatch.setattr(_compat, "version", lambda name: "0.5.9")
    with pytest.raises(_compat.UnsupportedSglangError, match="supports SGLang 0.5.17; found SGLang 0.5.9"):
        _compat.check_sglang()


@pytest.mark.parametrize("share", [1, 4])
def test_eval_arguments_are_server_args(share):
    """Every argument ``latentspeed eval`` gives ``sglang.Engine`` is one of SGLang's server arguments."""
    from dataclasses import fields

    from latentspeed.evaluate import sglang_kwargs

    spec = dict(model="m", kv_cache_dtype="fp8_e4m3", quantization="latentspeed_fp8", attention_backend="latentspeed",
                windows=[[1] * 512] * 3, eager=True, prefill_chunk=128, gpu_share=share)
    kwargs = sglang_kwargs(spec)
    assert set(kwargs) <= {f.name for f in fields(ServerArgs)}
    assert kwargs["page_size"] == 64 and kwargs["disable_cuda_graph"]
    assert kwargs.get("max_total_tokens") == (None if share == 1 else 16 * 512 + 4096)


def test_gpu_e2e_engines_are_sglang_arguments(monkeypatch):
    """``tests/gpu/sglang_e2e.py``'s engines are SGLang server arguments with values its command line accepts,
    and its pairs name known engines: a wrong name fails here, not after minutes on the GPU host."""
    from dataclasses import fields
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "gpu"))
    import sglang_e2e

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    choices = ("attention_backend", "prefill_attention_backend", "kv_cache_dtype", "quantization")
    for engine in sglang_e2e.ENGINES:
        kwargs = sglang_e2e.engine_kwargs("/models/tiny-dsv3", engine)
        assert set(kwargs) <= {f.name for f in fields(ServerArgs)}, engine
        argv = ["--model-path", kwargs["model_path"]]
        for name in choices:
            if kwargs[name] is not None:
                argv += [f"--{name.replace('_', '-')}", kwargs[name]]
        parsed = parser.parse_args(argv)
        assert all(getattr(parsed, name) == kwargs[name] for name in choices), engine
    paired = {engine for pairs in sglang_e2e.PAIRS.values() for pair in pairs for engine in pair}
    assert paired | set(sglang_e2e.PREFILL_BACKENDS) <= set(sglang_e2e.ENGINES)
