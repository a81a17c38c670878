"""CUDA graph capture of a fixed-shape step for the runner's steps over the workspace (runner.py).

A step is first run for real on a side stream (its errors are the model's own), then captured; the real run computes
what the replay recomputes, so capturing mid-request is safe. CaptureFailed: the caller runs eagerly from now on (auto
mode) or raises. CaptureRefused (too little device memory) is only this step's.
"""
from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import Callable
from typing import Any, TypeVar

import torch

T = TypeVar("T")
log = logging.getLogger(__name__)

# Device memory a capture must find free: a capture that runs out of memory aborts the process, where an eager forward
# raises.
CAPTURE_MIN_FREE_BYTES = 256 << 20


class CaptureFailed(RuntimeError):
    """A step could not be captured: `cause` says why (the capture's own error, or a refusal)."""

    def __init__(self, cause: Exception):
        super().__init__(str(cause))
        self.cause = cause


class CaptureRefused(CaptureFailed):
    """Too little device memory to capture now: nothing was run or captured, and a later capture may succeed."""


def capture_refusal(device: torch.device) -> str | None:
    """Why a CUDA graph must not be captured on `device` now (None: it may). A capture can have the driver's free
    memory plus the allocator's unused cache."""
    free, _ = torch.cuda.mem_get_info(device)
    room = free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if room < CAPTURE_MIN_FREE_BYTES:
        return (f"{room >> 20} MiB of device memory free, under the {CAPTURE_MIN_FREE_BYTES >> 20} MiB a capture "
                "needs")
    return None


def capture_step(run: Callable[[], T], device: torch.device) -> tuple[torch.cuda.CUDAGraph, T]:
    """(graph, what run() returned inside it): replaying the graph recomputes that output in place. Captured on `device`
    on its own stream in thread-local mode, since the write-behind thread may copy K/V off the device meanwhile."""
    refusal = capture_refusal(device)
    if refusal is not None:
        raise CaptureRefused(RuntimeError(refusal))
    with torch.cuda.device(device):
        main = torch.cuda.current_stream(device)
        side = torch.cuda.Stream(device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            run()  # an error here is the model's own: it propagates
        main.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # A private pool per graph: pools shared across recapture generations trip the caching allocator (torch 2.11).
        pool = torch.cuda.graph_pool_handle()
        try:
            with torch.cuda.graph(graph, pool=pool, stream=side, capture_error_mode="thread_local"):
                out = run()
        except Exception as exc:  # an op that cannot be captured (a host sync somewhere in the model)
            # When ending a failed capture fails, torch's graph context neither restores the stream nor stops routing
            # allocations to the graph's pool: undone here.
            torch.cuda.set_stream(main)
            index = device.index if device.index is not None else torch.cuda.current_device()
            with contextlib.suppress(RuntimeError, AttributeError):  # the allocator's capture ended (or never began)
                torch._C._cuda_endAllocateToPool(index, pool)  # noqa: SLF001 - the only handle on this torch state
            raise CaptureFailed(exc) from exc
    return graph, out


class GraphSteps:
    """What the runners share: a fixed-shape step runs eagerly or replays its graph (captured on first use). A failed
    capture gives graphs up (auto mode, counted, `failure` says why) or raises. Subclasses set mode,
    fallback_on_failure, stats and failure, and define _run, _device and _forget_graphs."""

    mode: str
    fallback_on_failure: bool
    stats: Counter  # steps, replays, captures, capture refusals and failures, ...
    failure: str | None

    def _execute(self, step: Any) -> torch.Tensor:
        self.stats["steps"] += 1
        if self.mode == "graphs" and step.graph is None:
            self._capture(step)
        if self.mode != "graphs" or step.graph is None:
            step.logits = self._run(step)
        else:
            step.graph.replay()
            self.stats["replays"] += 1
        return step.logits

    def _capture(self, step: Any) -> None:
        try:
            step.graph, step.logits = capture_step(lambda: self._run(step), self._device())
            self.stats["captures"] += 1
        except CaptureRefused as refused:  # the device is short of memory now: this step runs eagerly, the next
            if not self.fallback_on_failure:  # tries to capture again
                raise refused.cause from None
            self.stats["capture_refusals"] += 1
            log.warning("kvboost: CUDA graph capture refused (%s); this step runs eagerly", refused.cause)
        except CaptureFailed as failed:
            if not self.fallback_on_failure:
                raise failed.cause from None
            self.failure = f"{type(failed.cause).__name__}: {str(failed.cause).splitlines()[0][:200]}"
            log.warning("kvboost: CUDA graph capture failed (%s); these steps run eagerly", self.failure)
            self.stats["capture_failures"] += 1
            self.mode = "eager"
            self._forget_graphs()
