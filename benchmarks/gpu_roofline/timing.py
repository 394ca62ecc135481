"""Timing for the GPU benchmark: synchronised samples, their p50 / p99, and the run's time
budget (the whole run must fit the GPU machine's ~8 minutes, warm-up included)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def samples(fn: Callable[[], object], runs: int, device: torch.device, warmup: int = 1) -> list:
    """Seconds of each of ``runs`` calls of ``fn`` after ``warmup`` untimed ones, the device
    synchronised around each call (queued work counts where it runs)."""
    for _ in range(warmup):
        fn()
    sync(device)
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        sync(device)
        out.append(time.perf_counter() - t0)
    return out


def percentile(xs: list[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation between the sorted samples."""
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summary_ms(seconds: list[float]) -> dict:
    """``{"p50", "p99"}`` in ms and ``runs`` (the number of samples)."""
    return {
        "p50": round(1e3 * percentile(seconds, 50), 4),
        "p99": round(1e3 * percentile(seconds, 99), 4),
        "runs": len(seconds),
    }


class Budget:
    """The seconds a run may take; a part that would not fit is skipped and says so."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.start = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def left(self) -> float:
        return self.seconds - self.elapsed()

    def allows(self, cost_s: float, reserve_s: float = 0.0) -> bool:
        """Whether ``cost_s`` more seconds fit with ``reserve_s`` kept for what must follow."""
        return self.left() - reserve_s >= cost_s
