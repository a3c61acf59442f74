"""``benchmarks.mla_prefill``'s case syntax and the query-key pair count its TFLOP/s divide by."""

import argparse
import json
import os
import sys
from pathlib import Path

import pytest
import torch
import triton

from benchmarks import mla_prefill
from benchmarks.mla_prefill import kept_pairs, parse_case


def test_cases_parse_and_bad_ones_are_named():
    assert parse_case("causal:64x1024") == ("causal", 64, 1024, 1024)
    assert parse_case("chunk:4x8192x16384") == ("chunk", 4, 8192, 16384)
    for bad in ("causal:4x8x8", "chunk:4x8", "window:4x8"):
        with pytest.raises(argparse.ArgumentTypeError, match=bad):
            parse_case(bad)


@pytest.mark.parametrize("len_q,len_k", [(1, 1), (7, 7), (5, 12), (64, 64), (3, 130)])
@pytest.mark.parametrize("causal", [True, False])
def test_kept_pairs_counts_the_mask(len_q, len_k, causal):
    rows = torch.arange(len_q)[:, None]
    cols = torch.arange(len_k)[None, :]
    mask = cols <= rows + (len_k - len_q) if causal else torch.ones(len_q, len_k, dtype=torch.bool)
    assert kept_pairs(3, len_q, len_k, causal) == 3 * int(mask.sum())


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs our kernel under the Triton interpreter")
def test_a_small_run_writes_rows_within_the_reference(tmp_path, monkeypatch):
    """The whole benchmark at toy sizes on the CPU (interpreter; one untimed call stands in for the timing)."""
    monkeypatch.setattr(mla_prefill, "DEVICE", "cpu")
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kwargs: (fn(), 2.0)[1])
    out = tmp_path / "prefill.json"
    monkeypatch.setattr(sys, "argv", ["mla_prefill", "--heads", "2", "--cases", "causal:2x16", "chunk:1x8x24",
                                      "--providers", "latentspeed", "--check-tokens", "8", "--out", str(out)])
    mla_prefill.main()
    rows = json.loads(out.read_text())["rows"]
    shapes = [(r["case"], r["seqs"], r["len_q"], r["len_k"]) for r in rows]
    assert shapes == [("causal", 2, 16, 16), ("chunk", 1, 8, 24)]
    assert all(r["rel_err"] < 1e-2 for r in rows)
    assert rows[0]["tflop_s"] == pytest.approx(2 * 2 * (192 + 128) * kept_pairs(2, 16, 16, True) / 2.0 / 1e9)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs our kernel under the Triton interpreter")
def test_base_revision_runs_beside_ours(tmp_path, monkeypatch):
    """``--base`` times a revision's prefill.py as latentspeed-base, and each row gives the speed-up against it."""
    base_dir = tmp_path / "base"
    base_dir.mkdir()
    (base_dir / "prefill.py").write_text(Path(mla_prefill.__file__).parents[1].joinpath(
        "common_kernels", "mla", "prefill.py").read_text())
    monkeypatch.setattr(mla_prefill, "DEVICE", "cpu")
    times = iter([2.0, 3.0])
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kwargs: (fn(), next(times))[1])
    out = tmp_path / "ab.json"
    monkeypatch.setattr(sys, "argv", ["mla_prefill", "--heads", "1", "--cases", "causal:1x16", "--providers",
                                      "latentspeed", "--base", str(base_dir), "--check-tokens", "8", "--out", str(out)])
    mla_prefill.main()
    rows = json.loads(out.read_text())["rows"]
    assert [r["provider"] for r in rows] == ["latentspeed", "latentspeed-base"]
    assert all(r["rel_err"] < 1e-2 for r in rows)
    assert rows[0]["ours_speedup_vs_latentspeed-base"] == pytest.approx(1.5)
    assert all("BLOCK_M: 16" in r["config"] for r in rows)  # the interpreter's one config, as each side took it
