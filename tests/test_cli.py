"""The ``latentspeed`` command, run as a user runs it."""

import json
import subprocess
import sys

import pytest


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "latentspeed", *args], capture_output=True, text=True, timeout=600)


def test_info_reports_versions_gpu_and_components():
    pytest.importorskip("vllm")
    proc = run_cli("info", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["versions"]["vllm"] == "0.26.0"
    assert report["versions"]["torch"].startswith("2.11")
    names = [c["component"] for c in report["components"]]
    assert "vllm MLA decode (fp8_e5m2 cache)" in names and "vllm MLA prefill" in names
    if not report["gpu"]["available"]:
        assert report["mla_decode_kernel"].startswith("Triton (no GPU")
    for component in report["components"]:
        assert component["usable"] or component["why"], component  # every refusal says why


def test_demo_without_gpu_checks_kernels_against_reference():
    proc = run_cli("demo")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("kernel vs reference") == 3
    assert proc.stdout.rstrip().endswith("ok")


def test_unknown_command_is_refused():
    proc = run_cli("serve-everything")
    assert proc.returncode == 2
    assert "invalid choice" in proc.stderr


def test_info_names_the_fp8_launch_table_of_the_gpu(monkeypatch):
    """``latentspeed info``'s ``fp8_tables``: the shipped H200 and H100 tables, and for a card without one that
    the untuned defaults run and how to tune."""
    from latentspeed.cli import _fp8_tables

    for kind in ("GEMM", "MOE"):
        monkeypatch.delenv(f"LATENTSPEED_FP8_{kind}_CONFIGS", raising=False)
    assert _fp8_tables({"available": False}) == {"gemm": "no GPU: the interpreter's launches",
                                                 "moe": "no GPU: the interpreter's launches"}
    h200 = _fp8_tables({"available": True, "name": "NVIDIA H200"})
    assert h200["gemm"].endswith("gemm_NVIDIA_H200.json (12 shapes tuned; others run the untuned defaults)")
    assert h200["moe"].endswith("moe_NVIDIA_H200.json (3 shapes tuned; others run the untuned defaults)")
    h100 = _fp8_tables({"available": True, "name": "NVIDIA H100 80GB HBM3"})
    assert h100["gemm"].endswith("gemm_NVIDIA_H100_80GB_HBM3.json (12 shapes tuned; others run the untuned defaults)")
    assert h100["moe"].endswith("moe_NVIDIA_H100_80GB_HBM3.json (2 shapes tuned; others run the untuned defaults)")
    h20 = _fp8_tables({"available": True, "name": "NVIDIA H20"})
    assert "python -m benchmarks.tune_fp8_moe --out FILE, then LATENTSPEED_FP8_MOE_CONFIGS=FILE" in h20["moe"]
