"""The kernels compile for Hopper (sm_90a) on a machine without a GPU, as launched: the interpreter
that runs the other kernel tests accepts code that Triton's GPU compiler may reject, and this
checks what the H200 will get. Run in a process of its own, without TRITON_INTERPRET."""

import json
import os
import subprocess
import sys

from pathlib import Path

import pytest

from common_kernels.mla.decode_sm90_narrow import PAIRED_BUFS

REPO = Path(__file__).resolve().parents[2]


def hopper_compile(*args: str, **environ: str) -> dict:
    env = {key: value for key, value in os.environ.items()
           if key not in ("TRITON_INTERPRET", "LATENTSPEED_MLA_DECODE_PAIRED")} | environ
    done = subprocess.run([sys.executable, "-m", "benchmarks.hopper_compile", "--json", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return {report["label"]: report for report in json.loads(done.stdout)}


def test_every_kernel_compiles_for_hopper():
    reports = hopper_compile("all")
    assert len(reports) == 48
    for label, report in reports.items():
        if label.startswith("decode, "):
            assert report["async_copies"] + report["tma_copies"] > 0, f"{label}: the tile loads are not asynchronous"
            if "128 heads" in label:  # 64-row groups: wgmma
                assert report["wgmma"] > 0, f"{label}: no wgmma"
    for label in ("decode, 128 heads, bf16", "decode, 128 heads, e4m3", "prefill, 192/128, causal", "gemm 64x128",
                  "gemm sm90 128x128", "gemm sm90 128x64", "moe gate/up gemm", "moe down gemm"):
        assert reports[label]["wgmma"] > 0 and reports[label]["async_copies"] > 0, label
    for label in ("gemm 64x128", "gemm sm90 128x128", "gemm sm90 128x64", "gemm 16x128, swapped",
                  "gemm 16x128, swapped, K splits summed in the launch"):
        assert reports[label]["spill_bytes"] == 0, label
    summed = reports["gemm 16x128, swapped, K splits summed in the launch"]  # the split sum keeps the wgmma
    assert summed["wgmma"] == reports["gemm 16x128, swapped"]["wgmma"] > 0 and not summed["wgmma_serialized"]
    # the warp-specialized GEMM: one producer warp's two bulk tensor copies a K block; four wgmma a K
    # block at four places in each of the two consumer warpgroups (the first K block, the pair's two
    # in the loop, the one left after it); nothing copied by threads, no spills under the launch's
    # 168 registers a thread (the consumers get 232 each by setmaxnreg); C by bulk stores (224 KiB of
    # shared memory at 128 x 128 with six stages, under the 227 KiB checked below) or from registers
    # The fused MoE's down GEMM (grouped: B rows and scales by each row block's expert, C rows weighted) alike,
    # and its gate/up GEMM of SEPARATE_ACT (grouped, C rows not weighted); and K splits (fp32 partials).
    for label in ("gemm sm90 ws 128x128", "gemm sm90 ws 128x64", "gemm sm90 ws 128x128, C from registers",
                  "moe down gemm, sm90 ws 128x128", "moe gate/up gemm, sm90 ws 128x128, products",
                  "gemm sm90 ws 128x64, split 4", "gemm sm90 ws 128x128, split 2"):
        report = reports[label]
        assert (report["tma_copies"], report["wgmma"], report["async_copies"]) == (2, 32, 0), label
        assert report["spill_bytes"] == 0 and report["registers"] <= 168, label
    # the MoE's gate/up kernel (moe_sm90_ws): three bulk copies a K block (A, gate rows, up rows), two
    # wgmma a K block at each of those four places (gate and up), the same registers
    report = reports["moe gate/up gemm, sm90 ws, quantizing"]
    assert (report["tma_copies"], report["wgmma"], report["async_copies"]) == (3, 64, 0)
    assert report["spill_bytes"] == 0 and report["registers"] <= 168
    assert all(report["shared_bytes"] <= 227 * 1024 for report in reports.values())
    serialized = [label for label, report in reports.items() if report["wgmma_serialized"]]
    assert not serialized, f"ptxas serializes the wgmma of {serialized} (C7511: short of registers; C7514/C7515: " \
                           "other instructions touch an in-flight accumulator)"
    # 16 heads over a paged fp8 cache: the narrow kernel's tiles come by bulk tensor copies, one box
    # of 64 rows by 128 bytes for each quarter of the latent part and one for the RoPE part. Paired
    # programs (the plan's choice at batch 128) issue them in three places (the ring's first
    # PAIRED_BUFS - 2 tiles, unrolled, and each warpgroup's refill), each warpgroup with its own copy
    # of the loop; unpaired (LATENTSPEED_MLA_DECODE_PAIRED=0), in two (the ring's first tile and the
    # refill). Two tokens spill a few words (36 B since the word-wise _zero_tail, 28 B before: the added
    # word is stored before the tile loop and reloaded after it; two reloads a tile, as before)
    for label in ("decode, 16 heads, e4m3", "decode, 16 heads, e4m3, 2 tokens",
                  "decode, 16 heads, e4m3, extend prefix"):
        assert reports[label]["tma_copies"] == 5 * (PAIRED_BUFS - 2 + 2), label
        assert reports[label]["async_copies"] == 0 and reports[label]["spill_bytes"] <= 36, label
        _assert_partitions_keep_their_barriers(reports[label], label)
    for q_len, label in ((1, "decode, 16 heads, e4m3"), (2, "decode, 16 heads, e4m3, 2 tokens")):
        unpaired, = hopper_compile("decode", "--heads", "16", "--cache", "e4m3", "--q-len", str(q_len),
                                   LATENTSPEED_MLA_DECODE_PAIRED="0").values()
        assert unpaired["tma_copies"] == 2 * 5 and unpaired["async_copies"] == 0, label
        assert reports[label]["wgmma"] == 2 * unpaired["wgmma"], label
    # the fused MoE's capped launches (tune_fp8_moe.gemm_launches): under a cap of 168 registers, three
    # programs of 4 warps a multiprocessor by registers and by shared memory, few spills; the down
    # GEMM's launch without the cap needs more (two programs)
    for label in ("moe gate/up, quantizing, capped gemm", "moe down, capped gemm"):
        capped = reports[label]
        assert capped["registers"] <= 168 and capped["spill_bytes"] <= 128, label
        assert 3 * capped["shared_bytes"] <= 227 * 1024, label
    assert reports["moe down gemm"]["registers"] > 168 and reports["moe down, capped gemm"]["wgmma"] > 0
    # tiles of 16 rows (decode): as A B^T Triton falls back to mma.sync (Hopper's wgmma takes at least 64 rows
    # as its M); as B A^T (SWAP_AB) the weight's rows fill wgmma's M and the 16 rows its N, without spills
    for label, swapped_label in (("gemm 16x128", "gemm 16x128, swapped"),
                                 ("moe gate/up, quantizing, 16-row runs gemm",
                                  "moe gate/up, quantizing, 16-row runs, swapped gemm"),
                                 ("moe down, 16-row runs gemm", "moe down, 16-row runs, swapped gemm")):
        swapped = reports[swapped_label]
        assert reports[label]["wgmma"] == 0 < swapped["wgmma"], label
        assert swapped["mma_layouts"] == ["warpsPerCTA = [4, 1], instrShape = [16, 16, 32]"], label
        assert swapped["spill_bytes"] == 0 and swapped["async_copies"] > 0, label
    for label in ("decode, 128 heads, bf16", "decode, 128 heads, e4m3"):
        _assert_partitions_keep_their_barriers(reports[label], label)
    assert reports["decode, 16 heads, bf16"]["tma_copies"] == 0 < reports["decode, 16 heads, bf16"]["async_copies"]
    # 64-row groups over a paged cache compile decode_sm90_seesaw: each warpgroup its own partition
    # ([4, 1] warps) with a whole 64-key score tile and half the output columns, under the launch's
    # register cap. 16-bit caches: O = P V, [64, 256] a warpgroup, no spills. fp8 caches: P V in fp8
    # (O^T = V^T P^T, V^T from registers in two chunks of 128 latent rows a warpgroup) under a cap of
    # 248, without the widened V buffers, so with two pairs of tile buffers (194 KiB of shared memory, and 8 KiB
    # to regroup O^T for its stores, sm90_common._store_out); with
    # LATENTSPEED_MLA_DECODE_FP8_PV=0, V widened to fp16 and a few words of spills (36-44 B a thread)
    wide_layout, fp8_layout = ("warpsPerCTA = [4, 1], instrShape = [16, 256, 16]",
                               "warpsPerCTA = [4, 1], instrShape = [16, 64, 32]")
    bf16 = reports["decode, 128 heads, bf16"]
    assert bf16["registers"] <= 240 and bf16["spill_bytes"] == 0
    assert set(bf16["mma_layouts"]) == {"warpsPerCTA = [4, 1], instrShape = [16, 64, 16]", wide_layout}
    for label in ("decode, 128 heads, e4m3", "decode, 128 heads, e4m3, extend prefix"):
        report = reports[label]
        assert report["registers"] <= 248 and report["spill_bytes"] <= 16, label
        assert report["mma_layouts"] == [fp8_layout] and 180 * 1024 < report["shared_bytes"] <= 202 * 1024, label
    widened, = hopper_compile("decode", "--heads", "128", "--cache", "e4m3", LATENTSPEED_MLA_DECODE_FP8_PV="0").values()
    assert widened["registers"] <= 240 and widened["spill_bytes"] <= 48
    assert set(widened["mma_layouts"]) == {fp8_layout, wide_layout}


def _assert_partitions_keep_their_barriers(report: dict, label: str) -> None:
    """A kernel of two warp-specialized warpgroups: until they first meet at a named barrier, no
    barrier id of Triton's own is used by both (the paired decode kernel's first build shared one
    and raced: ``hopper_compile.partition_barrier_ids``)."""
    first, second = report["partition_barrier_ids"]
    assert first and second and not set(first) & set(second), f"{label}: {report['partition_barrier_ids']}"


def test_gemm_register_cap_reaches_ptxas():
    """The tuner's ``maxnreg`` candidate (three 64 x 128 programs an SM) compiles under its cap, with
    the wgmma still in flight."""
    capped, = hopper_compile("gemm", "--block", "64", "128", "--stages", "3", "--maxnreg", "168").values()
    free, = hopper_compile("gemm", "--block", "64", "128", "--stages", "3").values()
    assert capped["registers"] <= 168 < free["registers"] and not capped["wgmma_serialized"]
    assert capped["spill_bytes"] <= 32 and 3 * capped["shared_bytes"] <= 227 * 1024


def test_decode_settings_and_sass_reach_the_compile():
    """``decode --set`` compiles the launch variant that constant makes (one pair of tile buffers instead of the two
    that take 180-202 KiB above), and ``--sass`` counts its instructions: every wgmma an fp8 one (QGMMA), as many
    as the PTX's; ``O^T`` regrouped for 16-byte stores (``sm90_common._store_out``: a thread's 256 bytes of a
    128-column chunk as 16 stores, two chunks a warpgroup, two warpgroups), beside a few 32-bit ones (the lse)."""
    one_pair, = hopper_compile("decode", "--heads", "128", "--cache", "e4m3", "--sass",
                               "--set", "decode_sm90_seesaw.FP8_PV_RING_PAIRS=1").values()
    opcodes = dict(one_pair["sass_opcodes"])
    assert 100 * 1024 < one_pair["shared_bytes"] < 150 * 1024
    assert opcodes["QGMMA"] == one_pair["wgmma"] > 0 and "HGMMA" not in opcodes
    assert opcodes["STG.128"] == 64 and opcodes["STG"] <= 4
    assert list(opcodes.values()) == sorted(opcodes.values(), reverse=True) and opcodes["EXIT"] >= 1


def test_decode_settings_are_checked_before_compiling(monkeypatch):
    from benchmarks import hopper_compile as module

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="MODULE.NAME=INT"):
        module.main(["decode", "--set", "decode_sm90_seesaw.NO_SUCH=1"])


def test_refuses_the_interpreter():
    done = subprocess.run([sys.executable, "-m", "benchmarks.hopper_compile", "gemm"], cwd=REPO,
                          env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=600)
    assert done.returncode != 0 and "unset it" in done.stderr


def test_unknown_arguments_are_named():
    from benchmarks.hopper_compile import compile_for_hopper
    from common_kernels.fp8.gemm import _split_k_sum_kernel

    with pytest.raises(ValueError, match="no_such_ptr"):
        compile_for_hopper(_split_k_sum_kernel, {"no_such_ptr": None}, {}, 4, 1)


def test_each_prefill_config_fits_the_shared_memory_it_is_chosen_by():
    """``prefill_config`` picks the block config by ``shared_memory_needed``: compiled, no config may take more, and
    none may spill."""
    from common_kernels.mla.prefill import _PREFILL_CONFIGS, LAUNCH_VARIANTS, shared_memory_needed

    reports = hopper_compile("prefill")
    assert len(reports) == len(LAUNCH_VARIANTS) * len(_PREFILL_CONFIGS)
    for config in _PREFILL_CONFIGS:
        for kind in ("causal", "causal, lse", "chunk"):
            report = reports[f"prefill {config}, {kind}"]
            assert report["shared_bytes"] <= shared_memory_needed(config, 192, 128, 2), (config, kind)
            assert report["spill_bytes"] == 0 and report["async_copies"] > 0, (config, kind)
