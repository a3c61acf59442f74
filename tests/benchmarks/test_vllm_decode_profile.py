import gzip
import json

import pytest

from benchmarks import vllm_decode_profile as vdp


def test_busy_time_counts_overlapping_kernels_once():
    assert vdp.busy_us([(0, 10), (5, 12), (20, 25), (21, 22)]) == 17


def test_trace_summary_splits_kernel_time_from_idle_time(tmp_path, monkeypatch):
    monkeypatch.setattr(vdp, "STEPS", 2)
    events = [
        {"cat": "kernel", "name": "attn", "ts": 100, "dur": 30},
        {"cat": "kernel", "name": "gemm", "ts": 120, "dur": 20},  # overlaps attn by 10
        {"cat": "kernel", "name": "attn", "ts": 300, "dur": 30},
        {"cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 90, "dur": 5},
        {"cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 290, "dur": 5},
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 95, "dur": 5},
        {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 1000},
    ]
    path = tmp_path / "worker.pt.trace.json.gz"
    path.write_bytes(gzip.compress(json.dumps({"traceEvents": events}).encode()))
    summary = vdp.summarize_trace(path)
    assert summary["span_us_per_step"] == pytest.approx((330 - 100) / 2)
    assert summary["gpu_busy_us_per_step"] == pytest.approx(70 / 2)
    assert summary["kernel_us_per_step"] == pytest.approx(80 / 2)
    assert summary["graph_launches_per_step"] == 1
    assert summary["top_kernels_us_per_step"] == {"attn": 30, "gemm": 10}


def test_self_cpu_per_step_reads_the_profiler_tables_total(monkeypatch):
    monkeypatch.setattr(vdp, "STEPS", 64)
    table = "---\n  Name  Self CPU %  ...\n---\nSelf CPU time total: 268.127ms\nSelf CUDA time total: 47.413ms\n"
    assert vdp.self_cpu_us_per_step(table) == pytest.approx(268127 / 64)
    assert vdp.self_cpu_us_per_step(table.replace("268.127ms", "1.5s")) == pytest.approx(1.5e6 / 64)
    assert vdp.self_cpu_us_per_step("no totals here") is None
