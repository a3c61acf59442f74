"""The warm-up on the CPU: its switch (Triton's interpreter compiles nothing, so nothing runs there, and
``LATENTSPEED_FP8_WARMUP`` takes 0 or 1 only), the batch sizes it picks and its count of the Triton kernels it
built and loaded. What it does on a GPU: ``tests/gpu/test_fp8_warmup.py``."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common_kernels.fp8 import warmup

REPO = Path(__file__).resolve().parents[2]


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


COMPILE_TWICE = """
import json
import triton, triton.language as tl
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from common_kernels.fp8 import warmup

@triton.jit
def add_one(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)

heard = []
knobs.compilation.listener = before = lambda **kwargs: heard.append(kwargs["cache_hit"])
src = ASTSource(add_one, {"x_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}, {"BLOCK": 64})
counts = []
for _ in range(2):
    with warmup.counting_compiles() as compiles:
        triton.compile(src, target=GPUTarget("cuda", 90, 32))
    counts.append(dict(compiles, cache_dirs=sorted(compiles["cache_dirs"])))
print(json.dumps({"counts": counts, "heard": heard, "restored": knobs.compilation.listener is before}))
"""


def test_counting_compiles_tells_kernels_built_from_kernels_loaded(tmp_path):
    """A real compile for sm_90 (no GPU needed) into an empty cache folder, then the same kernel again: built,
    then loaded from the folder; a listener set before still hears both and is back in place after. In a process
    of its own without the interpreter, which patches ``triton.language`` in the processes it runs in."""
    script, cache = tmp_path / "compile_twice.py", str(tmp_path / "triton")
    script.write_text(COMPILE_TWICE)  # Triton reads a kernel's source from its file
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=cache, PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["counts"] == [{"built": 1, "loaded": 0, "cache_dirs": [cache]},
                                {"built": 0, "loaded": 1, "cache_dirs": [cache]}]
    assert result["heard"] == [False, True] and result["restored"]
