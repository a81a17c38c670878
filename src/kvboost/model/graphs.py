"""CUDA graph capture of a fixed-shape step, shared by the runners over the workspace (runner.py) and over block
tables (table_runner.py).

A step is first run for real on a side stream (it compiles kernels and sets up cuBLAS; an error there is the
model's own and propagates), then captured. The real run computes exactly what the replay that follows
recomputes, so capturing mid-request is safe. A capture that cannot be made raises CaptureFailed, and the caller
decides: run eagerly from now on (auto mode) or raise.
"""
from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

T = TypeVar("T")
log = logging.getLogger(__name__)

# Device memory a capture must find free. Measured on an H100 with the device full (other processes): a capture
# that ran out of memory aborted the process (its failed CUDAGraph is destroyed), where an eager forward raises.
CAPTURE_MIN_FREE_BYTES = 256 << 20


class CaptureFailed(RuntimeError):
    """A step could not be captured: `cause` says why (a refusal, or the capture's own error)."""

    def __init__(self, cause: Exception):
        super().__init__(str(cause))
        self.cause = cause


def capture_refusal(device: torch.device) -> str | None:
    """Why a CUDA graph must not be captured on `device` now (None: it may)."""
    free, _ = torch.cuda.mem_get_info(device)
    if free < CAPTURE_MIN_FREE_BYTES:
        return (f"{free >> 20} MiB of device memory free, under the {CAPTURE_MIN_FREE_BYTES >> 20} MiB a capture "
                "needs")
    return None


def capture_step(run: Callable[[], T], device: torch.device) -> tuple[torch.cuda.CUDAGraph, T]:
    """(graph, what run() returned inside it): replaying the graph recomputes that output in place."""
    refusal = capture_refusal(device)
    if refusal is not None:
        raise CaptureFailed(RuntimeError(refusal))
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        run()  # an error here is the model's own: it propagates
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        # A private memory pool per graph: graphs are dropped and recaptured when the workspace grows, and
        # pools shared across such generations trip the caching allocator's bookkeeping (torch 2.11).
        with torch.cuda.graph(graph):
            out = run()
    except Exception as exc:  # an op that cannot be captured (a host sync somewhere in the model)
        raise CaptureFailed(exc) from exc
    return graph, out


@dataclass
class RunnerStats:
    counts: Counter = field(default_factory=Counter)  # steps, replays, captures, recaptures (per bucket)

    def as_dict(self) -> dict:
        return dict(self.counts)


class GraphSteps:
    """What the runners share: a fixed-shape step runs eagerly, or replays its graph (captured on first use); a
    capture that fails gives graphs up for good (auto mode: the steps run eagerly, counted, `failure` says why) or
    raises. Subclasses set mode, fallback_on_failure, stats and failure, and define _run, _device and
    _forget_graphs; a step has `graph` and `logits`."""

    mode: str
    fallback_on_failure: bool
    stats: RunnerStats
    failure: str | None

    def _run(self, step: Any) -> torch.Tensor:
        raise NotImplementedError

    def _device(self) -> torch.device:
        raise NotImplementedError

    def _forget_graphs(self) -> None:
        raise NotImplementedError

    def _execute(self, step: Any) -> torch.Tensor:
        self.stats.counts["steps"] += 1
        if self.mode == "graphs" and step.graph is None:
            try:
                step.graph, step.logits = capture_step(lambda: self._run(step), self._device())
                self.stats.counts["captures"] += 1
            except CaptureFailed as failed:
                self._give_up_graphs(failed.cause)
        if self.mode != "graphs":
            step.logits = self._run(step)
        else:
            step.graph.replay()
            self.stats.counts["replays"] += 1
        return step.logits

    def _give_up_graphs(self, exc: Exception) -> None:
        if not self.fallback_on_failure:
            raise exc
        self.failure = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        log.warning("kvboost: CUDA graph capture failed (%s); these steps run eagerly", self.failure)
        self.stats.counts["capture_failures"] += 1
        self.mode = "eager"
        self._forget_graphs()
