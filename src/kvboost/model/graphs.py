"""CUDA graph capture of a fixed-shape step, shared by the runners over the workspace (runner.py) and over block
tables (table_runner.py).

A step is first run for real on a side stream (it compiles kernels and sets up cuBLAS; an error there is the
model's own and propagates), then captured. The real run computes exactly what the replay that follows
recomputes, so capturing mid-request is safe. A capture that cannot be made raises CaptureFailed, and the caller
decides: run eagerly from now on (auto mode) or raise.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")

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
