"""The warm-up on the CPU: its switch (Triton's interpreter compiles nothing, so nothing runs there, and
``LATENTSPEED_FP8_WARMUP`` takes 0 or 1 only), the batch sizes it picks and its count of the Triton kernels it
built and loaded. What it does on a GPU: ``tests/gpu/test_fp8_warmup.py``."""

import pytest
import torch
import triton
import triton.language as tl
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from common_kernels.fp8 import warmup


def test_cpu_layers_are_not_warmed_up(monkeypatch):
    monkeypatch.setattr(warmup, "block_fp8_linear", lambda *args: pytest.fail("warmed up on the CPU"))
    for kernel in ("fused_moe_fp8", "rms_norm_group_quant", "silu_mul_group_quant"):
        monkeypatch.setattr(warmup, kernel, lambda *args, **kwargs: pytest.fail("warmed up on the CPU"))
    w = torch.zeros(128, 128).to(torch.float8_e4m3fn)
    s = torch.ones(1, 1)
    assert not warmup.warmup_wanted(torch.device("cpu"))
    assert not warmup.warm_up_linear(w, s, 16, torch.bfloat16)
    assert not warmup.warm_up_moe(w[None], s[None], w[None], s[None], 1, 16, torch.bfloat16)
    assert not warmup.warm_up_producers(128, 16, torch.bfloat16, torch.device("cpu"), True, True)


@pytest.mark.parametrize("setting, wanted", [("1", True), ("0", False)])
def test_switch(monkeypatch, setting, wanted):
    monkeypatch.setenv(warmup.WARMUP_ENV, setting)
    assert warmup.warmup_wanted(torch.device("cuda", 0)) is wanted


def test_switch_refuses_other_values(monkeypatch):
    monkeypatch.setenv(warmup.WARMUP_ENV, "yes")
    with pytest.raises(ValueError, match="LATENTSPEED_FP8_WARMUP='yes'"):
        warmup.warmup_wanted(torch.device("cuda", 0))


def test_representative_sizes_take_every_small_batch_then_one_of_each_launch(monkeypatch):
    monkeypatch.setattr(warmup, "FULL_SWEEP_TOKENS", 256)
    sizes = warmup.representative_sizes(956, lambda m: (m // 300, m % 16 == 0))  # a new config at 300, 600, 900
    assert sizes == list(range(1, 257)) + [257, 272, 300, 304, 600, 608, 900, 912]
    assert warmup.representative_sizes(5, lambda m: pytest.fail("no size above the full sweep")) == [1, 2, 3, 4, 5]


def _add_one(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)


def test_counting_compiles_tells_kernels_built_from_kernels_loaded(monkeypatch, tmp_path):
    """A real compile for sm_90 (no GPU needed) into an empty cache folder, then the same kernel again: built,
    then loaded from the folder; a listener set before still hears both and is back in place after."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    heard = []
    monkeypatch.setattr(knobs.compilation, "listener", lambda **kwargs: heard.append(kwargs["cache_hit"]))
    before = knobs.compilation.listener
    src = ASTSource(JITFunction(_add_one), {"x_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}, {"BLOCK": 64})
    with warmup.counting_compiles() as first:
        triton.compile(src, target=GPUTarget("cuda", 90, 32))
    with warmup.counting_compiles() as second:
        triton.compile(src, target=GPUTarget("cuda", 90, 32))
    assert first == {"built": 1, "loaded": 0, "cache_dirs": {str(tmp_path)}}
    assert second == {"built": 0, "loaded": 1, "cache_dirs": {str(tmp_path)}}
    assert heard == [False, True]
    assert knobs.compilation.listener is before
