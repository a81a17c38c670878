"""Clocks that see the device, percentiles, and per-section time budgets for `kvboost bench gpu`."""
from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:  # torch is imported by the functions that use it: the CLI registers this module
    import torch

T = TypeVar("T")


def sync(device: torch.device) -> None:
    """Wait for queued device work: CUDA kernels run asynchronously, so a host clock alone measures launches."""
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def timed(fn: Callable[[], T], device: torch.device) -> tuple[float, T]:
    """(milliseconds, result) of fn(), with the device drained before and after."""
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return (time.perf_counter() - t0) * 1e3, out


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 1]; nan for no values."""
    s = sorted(v for v in values if v is not None and math.isfinite(v))
    if not s:
        return float("nan")
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def median(values: Sequence[float]) -> float:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.median(finite) if finite else float("nan")


class Budget:
    """Seconds a section may spend. Sections check it between measurements, never inside one, so a section
    can overrun by one measurement; the section then reports itself truncated."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def expired(self) -> bool:
        return self.left() <= 0
