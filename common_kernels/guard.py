"""Numerics guard for fp8 quantizers: count what would otherwise be silently corrupted.

Quantizing kernels add, on the device and inside CUDA graphs, the number of values they
clamped at the fp8 maximum (``counters[0]``) and of non-finite inputs (``counters[1]``) to one
per-device counter pair. The engine adapters count steps (``Fp8Guard.step`` or ``step_all``, once
per forward pass); the host reads the pair every ``check_every`` steps, outside graph capture, and
acts by ``LATENTSPEED_FP8_GUARD``:

- ``warn`` (default): log once for each new batch of clamped or non-finite values;
- ``raise``: raise ``Fp8NumericsError``, which stops the engine instead of serving garbage;
- ``off``: do not read the counters.

Every read that finds new counts also adds them to two Prometheus counters,
``latentspeed:fp8_clamped_values_total`` and ``latentspeed:fp8_nonfinite_values_total``, when
Prometheus' multiprocess mode is on (``PROMETHEUS_MULTIPROC_DIR``, which SGLang's
``--enable-metrics`` sets before it starts the schedulers that run the model, and vLLM's
``--api-server-count`` above 1): the engine's ``/metrics`` then serves their sum over processes.
"""

import logging
import os

import torch

logger = logging.getLogger("latentspeed")

GUARD_MODES = ("warn", "raise", "off")


class Fp8NumericsError(RuntimeError):
    """An fp8 quantizer saw non-finite inputs or clamped values while LATENTSPEED_FP8_GUARD=raise."""


class Fp8Guard:
    def __init__(self, device: torch.device, check_every: int = 256):
        mode = os.environ.get("LATENTSPEED_FP8_GUARD", "warn").lower()
        if mode not in GUARD_MODES:
            raise ValueError(f"LATENTSPEED_FP8_GUARD={mode!r} is not one of {GUARD_MODES}")
        self.mode = mode
        self.check_every = check_every
        self.counters = torch.zeros(2, dtype=torch.int32, device=device)
        self._steps = 0
        self._reported = (0, 0)

    def step(self) -> None:
        """Call once per engine step; reads the counters every ``check_every`` steps."""
        self._steps += 1
        if self.mode != "off" and self._steps % self.check_every == 0:
            self.check()

    def check(self) -> tuple[int, int]:
        """Read the counters (a device sync) and warn or raise on anything new.

        Returns ``(saturated, nonfinite)`` totals since start-up.
        """
        if self.counters.is_cuda and torch.cuda.is_current_stream_capturing():
            return self._reported
        saturated, nonfinite = (int(v) for v in self.counters.tolist())
        if (saturated, nonfinite) != self._reported:
            message = (
                f"latentspeed fp8 guard: {saturated} values clamped at the fp8 maximum and "
                f"{nonfinite} non-finite values written so far (kv-cache scale too small, or "
                "non-finite activations upstream)"
            )
            _publish(saturated - self._reported[0], nonfinite - self._reported[1])
            self._reported = (saturated, nonfinite)
            if self.mode == "raise":
                raise Fp8NumericsError(message)
            logger.warning(message)
        return saturated, nonfinite


_GUARDS: dict[torch.device, Fp8Guard] = {}
_METRICS: list = []  # the two Prometheus counters, made on first use in a process


def _publish(clamped: int, nonfinite: int) -> None:
    """Add new counts to the Prometheus counters, in multiprocess mode only (a process-local
    registry would never reach the engine's ``/metrics``)."""
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return
    if not _METRICS:
        from prometheus_client import Counter  # imported once the directory is set, as the mode requires

        _METRICS.extend(Counter(f"latentspeed:fp8_{what}_values", f"Values latentspeed's fp8 quantizers {doc}")
                        for what, doc in (("clamped", "clamped at the fp8 maximum"),
                                          ("nonfinite", "saw non-finite (NaN or infinite)")))
    _METRICS[0].inc(clamped)
    _METRICS[1].inc(nonfinite)


def fp8_guard(device: torch.device | str) -> Fp8Guard:
    """The process-wide guard of ``device`` (one counter pair shared by every layer)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _GUARDS:
        _GUARDS[device] = Fp8Guard(device)
    return _GUARDS[device]


def step_all() -> None:
    """One step for every guard of this process: an engine hook calls this once per forward pass."""
    for guard in list(_GUARDS.values()):
        guard.step()
