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
