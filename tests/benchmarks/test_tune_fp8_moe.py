"""The fused MoE tuner's candidates (it runs on the GPU only; these are its choices)."""

import pytest
import torch

from benchmarks.tune_fp8_moe import (
    CAPPED_FROM_TOKENS,
    GEMM_LAUNCHES,
    WS_DOWN_FROM_TOKENS,
    WS_DOWN_LAUNCHES,
    gemm_launches,
)
from common_kernels.fp8 import gemm_sm90_ws


def test_register_caps_are_tried_from_many_tokens_on():
    assert list(gemm_launches(CAPPED_FROM_TOKENS - 1)) == GEMM_LAUNCHES
    launches = list(gemm_launches(CAPPED_FROM_TOKENS))
    capped = launches[len(GEMM_LAUNCHES):]
    assert launches[:len(GEMM_LAUNCHES)] == GEMM_LAUNCHES and len(capped) == 4
    for launch in capped:  # three programs of 4 warps a multiprocessor, or two of 8
        assert launch["BLOCK_N"] == 128 and launch["num_stages"] <= 3
        assert launch["maxnreg"] == {4: 168, 8: 128}[launch["num_warps"]]


@pytest.mark.parametrize("capability", [(9, 0), (8, 0)])
def test_ws_down_launches_are_tried_on_hopper_with_128_row_runs(monkeypatch, capability):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args: capability)
    tokens = max(WS_DOWN_FROM_TOKENS, CAPPED_FROM_TOKENS)
    plain = list(gemm_launches(tokens, "down", 64))
    assert all("KERNEL" not in launch for launch in plain)
    assert list(gemm_launches(tokens, "gate_up", 128)) == plain  # the gate/up GEMM has no such kernel
    ws = list(gemm_launches(tokens, "down", 128))[len(plain):]
    assert ws == (WS_DOWN_LAUNCHES if capability == (9, 0) else [])
    assert list(gemm_launches(WS_DOWN_FROM_TOKENS - 1, "down", 128)) == list(gemm_launches(WS_DOWN_FROM_TOKENS - 1))
    for launch in WS_DOWN_LAUNCHES:
        assert gemm_sm90_ws.fits(dict(launch, BLOCK_M=128))
