import pytest
import torch

from common_kernels.guard import Fp8Guard, Fp8NumericsError
from common_kernels.mla import write_latent_cache
from tests.helpers import device


def _write_overflowing_row(guard: Fp8Guard) -> None:
    kv_c = torch.full((1, 16), 1e6, dtype=torch.bfloat16, device=device())
    k_pe = torch.zeros(1, 16, dtype=torch.bfloat16, device=device())
    cache = torch.zeros(1, 16, 32, device=device()).to(torch.float8_e4m3fn)
    slots, scale = torch.zeros(1, dtype=torch.long, device=device()), torch.ones(1, device=device())
    write_latent_cache(kv_c, k_pe, cache, slots, scale, guard.counters)


def test_guard_raises_on_saturation(monkeypatch):
    monkeypatch.setenv("LATENTSPEED_FP8_GUARD", "raise")
    guard = Fp8Guard(torch.device(device()), check_every=2)
    guard.step()
    guard.step()  # nothing written yet: no error
    _write_overflowing_row(guard)
    guard.step()
    with pytest.raises(Fp8NumericsError, match="16 values clamped"):
        guard.step()


def test_guard_warns_once_per_new_count(monkeypatch, caplog):
    monkeypatch.setenv("LATENTSPEED_FP8_GUARD", "warn")
    guard = Fp8Guard(torch.device(device()))
    _write_overflowing_row(guard)
    assert guard.check() == (16, 0)
    assert guard.check() == (16, 0)
    assert sum("fp8 guard" in r.message for r in caplog.records) == 1


def test_guard_rejects_unknown_mode(monkeypatch):
    monkeypatch.setenv("LATENTSPEED_FP8_GUARD", "loud")
    with pytest.raises(ValueError, match="LATENTSPEED_FP8_GUARD='loud'"):
        Fp8Guard(torch.device("cpu"))


PUBLISHING = """
import sys, torch
from common_kernels.guard import Fp8Guard
from prometheus_client import CollectorRegistry, multiprocess
guard = Fp8Guard(torch.device("cpu"), check_every=1)
for clamped, nonfinite in ((0, 0), (3, 0), (3, 5), (4, 5)):  # totals after each pass
    guard.counters.copy_(torch.tensor([clamped, nonfinite], dtype=torch.int32))
    guard.step()
registry = CollectorRegistry()
multiprocess.MultiProcessCollector(registry)
values = {sample.name: sample.value for metric in registry.collect() for sample in metric.samples}
print(values.get("latentspeed:fp8_clamped_values_total"), values.get("latentspeed:fp8_nonfinite_values_total"))
"""


def test_guard_publishes_prometheus_counters_in_multiprocess_mode(tmp_path):
    """In a fresh process (the mode must be set before prometheus_client is imported), as an
    engine's worker would: the counters hold the totals the guard has read."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(tmp_path), LATENTSPEED_FP8_GUARD="warn")
    done = subprocess.run([sys.executable, "-c", PUBLISHING], env=env, capture_output=True, text=True, timeout=300,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["4.0", "5.0"]


def test_guard_publishes_nothing_without_multiprocess_mode(monkeypatch):
    from common_kernels import guard as guard_module

    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    monkeypatch.setenv("LATENTSPEED_FP8_GUARD", "warn")
    guard = Fp8Guard(torch.device("cpu"), check_every=1)
    guard.counters[1] += 2
    guard.step()
    assert guard_module._METRICS == [], "a process-local registry never reaches the engine's /metrics"
