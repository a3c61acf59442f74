"""The block-FP8 warm-up on a GPU: after ``warm_up_linear`` / ``warm_up_producers`` / ``warm_up_moe``
for ``1..max_tokens`` tokens, a batch of any of those sizes compiles no Triton kernel (counted, as vLLM's JIT monitor
counts them, through Triton's ``jit_post_compile_hook``), while before it a new size does.

    pytest tests/gpu/test_fp8_warmup.py -q          (skipped without a GPU)

Shapes of their own (so no other test in the process has compiled them), 1100 tokens, past ``FULL_SWEEP_TOKENS``,
where the warm-up runs one size of each launch key. On an sm_90 GPU (132 SMs) the untuned GEMM config of a
2816 x 1024 layer is the Triton kernel with two K splits below 256 rows, then the warp-specialized kernel, 64 columns
wide, 128 from 513 rows, with fewer stages from 1025. The MoE (6 experts, top 2) sorts in one launch up to 256
tokens, then in three with one, two and (from 1025) three programs, and its untuned config has 16-row runs up to 48
tokens, 64-row runs, then from 384 tokens the warp-specialized kernels.
"""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from triton import knobs

from common_kernels.fp8 import block_fp8_linear, fused_moe_fp8, rms_norm_group_quant, silu_mul_group_quant
from common_kernels.fp8.reference import quantize_weight_blocks_ref
from common_kernels.fp8.warmup import warm_up_linear, warm_up_moe, warm_up_producers
from common_kernels.guard import fp8_guard

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                                reason="needs a GPU with fp8 tensor cores")
MAX_TOKENS = 1100
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def compiles():
    """The names of the Triton kernels compiled while the test runs."""
    names, previous = [], knobs.runtime.jit_post_compile_hook

    def hook(**kwargs):
        names.append(getattr(kwargs.get("fn"), "name", "?"))
        return previous(**kwargs) if previous else None

    knobs.runtime.jit_post_compile_hook = hook
    yield names
    knobs.runtime.jit_post_compile_hook = previous


def _block_weight(rows: int, cols: int, *lead: int):
    w = torch.randn(*lead, rows, cols, device="cuda") / cols**0.5
    q, s = zip(*(quantize_weight_blocks_ref(m) for m in w.reshape(-1, rows, cols)))
    return torch.stack(q).view(*lead, rows, cols), torch.stack(s).view(*lead, *s[0].shape)


def _sizes_in_random_order():
    sizes = list(range(1, MAX_TOKENS + 1))
    random.Random(0).shuffle(sizes)
    return sizes


def test_linear_compiles_nothing_after_warm_up(compiles):
    weight, scale = _block_weight(22 * 128, 8 * 128)
    x = torch.randn(MAX_TOKENS, weight.shape[1], dtype=torch.bfloat16, device="cuda")
    block_fp8_linear(x[:7], weight, scale)
    torch.cuda.synchronize()
    assert compiles, "the hook saw no compile of a first launch: it would not see later ones either"
    assert warm_up_linear(weight, scale, MAX_TOKENS, torch.bfloat16)
    assert not warm_up_linear(weight, scale, MAX_TOKENS, torch.bfloat16), "a second layer of one signature"
    compiles.clear()
    for m in _sizes_in_random_order():
        block_fp8_linear(x[:m], weight, scale)
    torch.cuda.synchronize()
    assert compiles == []


def test_moe_compiles_nothing_after_warm_up(compiles):
    experts, hidden, inter, top_k = 6, 384, 256, 2
    w13, w13_scale = _block_weight(2 * inter, hidden, experts)
    w2, w2_scale = _block_weight(hidden, inter, experts)
    x = torch.randn(MAX_TOKENS, hidden, dtype=torch.bfloat16, device="cuda")
    logits = torch.randn(MAX_TOKENS, experts, device="cuda")
    weights, ids = logits.softmax(-1).topk(top_k)
    ids = ids.to(torch.int32)
    stats = fp8_guard(x.device).counters  # as the engines pass it
    fused_moe_fp8(x[:5], w13, w13_scale, w2, w2_scale, weights[:5], ids[:5], stats=stats, check_ids=False)
    torch.cuda.synchronize()
    assert compiles
    assert warm_up_moe(w13, w13_scale, w2, w2_scale, top_k, MAX_TOKENS, torch.bfloat16)
    compiles.clear()
    for m in _sizes_in_random_order():
        fused_moe_fp8(x[:m], w13, w13_scale, w2, w2_scale, weights[:m], ids[:m], stats=stats, check_ids=False)
    torch.cuda.synchronize()
    assert compiles == []


def test_producers_compile_nothing_after_warm_up(compiles):
    cols = 3 * 128 + 64
    x = torch.randn(MAX_TOKENS, 2 * cols, dtype=torch.bfloat16, device="cuda")
    rows, residual = x[:, :cols].contiguous(), x[:, cols:].contiguous()
    weight = torch.randn(cols, dtype=torch.bfloat16, device="cuda")
    stats = fp8_guard(x.device).counters

    def produce(m):  # as vllm_plugin/fusion.py's ops call them
        rms_norm_group_quant(rows[:m], weight, 1e-5, group_size=128, stats=stats)
        rms_norm_group_quant(rows[:m], weight, 1e-5, residual[:m], 128, stats=stats)
        silu_mul_group_quant(x[:m], 128, stats=stats)

    produce(3)
    torch.cuda.synchronize()
    assert compiles
    assert warm_up_producers(cols, MAX_TOKENS, torch.bfloat16, x.device, norm=True, silu_mul=True)
    compiles.clear()
    for m in _sizes_in_random_order():
        produce(m)
    torch.cuda.synchronize()
    assert compiles == []


def test_moe_warm_up_loads_every_kernel_from_the_disk_cache_in_a_second_process(tmp_path):
    """Two processes, one empty Triton cache folder: the second MoE warm-up builds nothing. (Inside vLLM the MoE's
    warm-up took as long at a second start as at the first, while the linears' fell to 0.2 s: forty-sixth session.)"""
    runs = []
    for i in range(2):
        out = tmp_path / f"run{i}.json"
        subprocess.run([sys.executable, "-m", "benchmarks.fp8_warmup_cost", "--moe", "6,384,256,2", "--max-tokens",
                        str(MAX_TOKENS), "--out", str(out)], check=True, cwd=REPO,
                       env=dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton")))
        runs.append(json.loads(out.read_text())["moe"]["warm_ups"][0])
    assert runs[0]["built"] > 0 and runs[0]["cache_dirs"] == [str(tmp_path / "triton")]
    assert runs[1]["built"] == 0 and runs[1]["loaded"] == runs[0]["built"] + runs[0]["loaded"], runs
