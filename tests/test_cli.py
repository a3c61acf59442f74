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
