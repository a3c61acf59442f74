"""The fused MoE tuner's candidates (it runs on the GPU only; these are its choices)."""

import pytest
import torch

from benchmarks.tune_fp8_moe import (
    CAPPED_FROM_TOKENS,
    GEMM_LAUNCHES,
    NARROW_LAUNCHES,
    NARROW_UP_TO_TOKENS,
    SWAP_BELOW_BLOCK_M,
    WS_FROM_TOKENS,
    WS_GROUP_M,
    WS_LAUNCHES,
    gemm_launches,
    search,
)
from common_kernels.fp8 import gemm_sm90_ws, moe_sm90_ws


def test_register_caps_are_tried_from_many_tokens_on():
    assert list(gemm_launches(CAPPED_FROM_TOKENS - 1, "down", 64)) == GEMM_LAUNCHES
    launches = list(gemm_launches(CAPPED_FROM_TOKENS, "down", 64))
    capped = launches[len(GEMM_LAUNCHES):]
    assert launches[:len(GEMM_LAUNCHES)] == GEMM_LAUNCHES and len(capped) == 4
    for launch in capped:  # three programs of 4 warps a multiprocessor, or two of 8
        assert launch["BLOCK_N"] == 128 and launch["num_stages"] <= 3
        assert launch["maxnreg"] == {4: 168, 8: 128}[launch["num_warps"]]


@pytest.mark.parametrize("stage", ["gate_up", "down"])
def test_narrow_tiles_are_tried_at_decode_sizes(stage):
    """16- and 32-wide tiles up to NARROW_UP_TO_TOKENS tokens (one token of DeepSeek-V3 under -tp 8: 8 experts
    times 256 gate/up columns, 32 programs at 64-wide tiles), none beyond."""
    assert {launch["BLOCK_N"] for launch in NARROW_LAUNCHES} == {16, 32}
    for tokens in (1, NARROW_UP_TO_TOKENS):
        plain = [launch for launch in gemm_launches(tokens, stage, 16) if not launch.get("SWAP_AB")]
        assert plain == GEMM_LAUNCHES + NARROW_LAUNCHES
    assert not any(launch["BLOCK_N"] < 64 for launch in gemm_launches(NARROW_UP_TO_TOKENS + 1, stage, 16))


def unswapped(launches):
    return [launch for launch in launches if not launch.get("SWAP_AB")]


@pytest.mark.parametrize("block_m", [16, 32, 64, 128])
def test_swapped_products_are_tried_for_short_runs(block_m):
    swapped = [launch for launch in gemm_launches(16, "gate_up", block_m) if launch.get("SWAP_AB")]
    expected = [dict(launch, SWAP_AB=True) for launch in GEMM_LAUNCHES] if block_m < SWAP_BELOW_BLOCK_M else []
    assert swapped == expected


@pytest.mark.parametrize("capability", [(9, 0), (8, 0)])
def test_ws_launches_are_tried_on_hopper_at_the_runs_they_take(monkeypatch, capability):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args: capability)
    tokens = max(WS_FROM_TOKENS, CAPPED_FROM_TOKENS)
    plain = list(gemm_launches(tokens, "down", 64))  # no warp-specialized kernel takes 64-row runs for down
    assert all("KERNEL" not in launch for launch in plain)
    hopper = capability == (9, 0)
    fused = [launch for launch in WS_LAUNCHES["gate_up"] if not launch.get("SEPARATE_ACT")]
    separate = [launch for launch in WS_LAUNCHES["gate_up"] if launch.get("SEPARATE_ACT")]
    assert len(fused) == 3 and len(separate) == 4
    for stage, block_m, expected in (("down", 128, WS_LAUNCHES["down"]), ("down", 64, []),
                                     ("gate_up", 64, fused), ("gate_up", 128, fused + separate),
                                     ("gate_up", 32, [])):
        assert unswapped(gemm_launches(tokens, stage, block_m)) == plain + (expected if hopper else [])
        assert unswapped(gemm_launches(WS_FROM_TOKENS - 1, stage, block_m)) == GEMM_LAUNCHES
    for launch in WS_LAUNCHES["down"] + separate:  # the grouped GEMM over 128-row runs
        assert gemm_sm90_ws.fits(dict(launch, BLOCK_M=128))
    for launch in fused:
        assert moe_sm90_ws.fits(dict(launch, BLOCK_M=64))


def test_search_pairs_each_run_lengths_best_gate_up_with_the_down_launches(monkeypatch):
    """Down launches are tried after the fastest gate/up of the same BLOCK_M. In this cost model SEPARATE_ACT
    is the fastest gate/up but only with 128-row runs, where Triton's down is slow, so with the default down
    it loses to 64-row runs; the warp-specialized down (128-row runs only) must then meet it, not the
    64-row runs' gate/up. Launches that fail (None) are passed over."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args: (9, 0))

    def fake_us(config):
        block_m, gate_up, down = config["BLOCK_M"], config["gate_up"], config["down"]
        if gate_up.get("maxnreg") or down.get("maxnreg"):
            return None
        if gate_up.get("SEPARATE_ACT"):
            gate_us = 3.0
        elif gate_up.get("KERNEL"):
            gate_us = 4.0 if block_m == 64 else 4.3
        else:
            gate_us = 5.0
        down_us = 1.6 if down.get("KERNEL") else 4.0 if block_m == 128 else 2.7
        return gate_us + down_us

    best = search(4096, fake_us)
    assert best["BLOCK_M"] == 128 and best["us"] == 4.6 and best["default_us"] == 7.7
    assert best["gate_up"].get("SEPARATE_ACT") and best["down"].get("KERNEL") == "sm90_ws"


@pytest.mark.parametrize("tokens", [64, 4096])
def test_search_orders_the_tiles_of_a_warp_specialized_winner(monkeypatch, tokens):
    """The winner's warp-specialized GEMMs are tried at each ``WS_GROUP_M`` (both at once), and a faster order
    is kept; a winner on the Triton kernels (no warp-specialized launch below ``WS_FROM_TOKENS``) gets none."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args: (9, 0))
    tried = []

    def fake_us(config):
        stages = (config["gate_up"], config["down"])
        tried.append(tuple(stage.get("GROUP_M") for stage in stages))
        ws = sum(1.0 for stage in stages if stage.get("KERNEL") and not stage.get("SEPARATE_ACT"))
        orders = {stage.get("GROUP_M", 8) for stage in stages if stage.get("KERNEL")}
        return 10.0 - ws - (0.25 if orders == {4} else 0.0)

    best = search(tokens, fake_us)
    if tokens < WS_FROM_TOKENS:
        assert all(order == (None, None) for order in tried)
        assert "GROUP_M" not in best["gate_up"] and "GROUP_M" not in best["down"]
    else:
        assert tried[-len(WS_GROUP_M):] == [(g, g) for g in WS_GROUP_M]
        assert best["gate_up"]["GROUP_M"] == best["down"]["GROUP_M"] == 4 and best["us"] == 7.75
