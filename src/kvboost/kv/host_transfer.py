"""Copies between a host workspace's buffers and the compute device: [kv_heads, n, d] ranges with heads `capacity *
d` apart go as one cudaMemcpy2DAsync (torch's copy_ would gather them into pageable memory first), else per head."""
from __future__ import annotations

import threading
from contextlib import AbstractContextManager, nullcontext

import torch

from .pinned import HOST_TO_DEVICE, cuda_runtime

DEVICE_TO_HOST = 2  # cudaMemcpyDeviceToHost


class _StridedCopy:
    """cudaMemcpy2DAsync through torch's runtime, looked up once; given up (per-head copies) on any error."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.fn = None
        self.status = "not tried"

    def get(self):
        with self.lock:
            if self.status == "not tried":
                try:
                    self.fn = cuda_runtime().memcpy2d_async
                    self.status = "one cudaMemcpy2DAsync per layer and K/V"
                except OSError as exc:
                    self.status = f"one copy per head: {exc}"
            return self.fn

    def give_up(self, reason: str) -> None:
        with self.lock:
            self.fn, self.status = None, f"one copy per head: {reason}"


_strided = _StridedCopy()  # .status: how host <-> CUDA copies of head ranges are made in this process


def copy_heads(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst <- src, both [kv_heads, n, d] with each head's [n, d] contiguous, on the current stream: one strided copy
    between host and CUDA (asynchronous from pinned memory), else one copy per head."""
    if dst.shape[1] == 0:
        return
    if not _copy_2d(dst, src):
        non_blocking = "cuda" in (dst.device.type, src.device.type)
        for h in range(dst.shape[0]):
            dst[h].copy_(src[h], non_blocking=non_blocking)


def _copy_2d(dst: torch.Tensor, src: torch.Tensor) -> bool:
    kinds = (dst.device.type, src.device.type)
    if kinds not in (("cuda", "cpu"), ("cpu", "cuda")) or dst.dtype != src.dtype or dst.shape != src.shape:
        return False
    if not (dst[0].is_contiguous() and src[0].is_contiguous()):
        return False
    fn = _strided.get()
    if fn is None:
        return False
    cuda = dst.device if kinds[0] == "cuda" else src.device
    size = dst.element_size()
    with torch.cuda.device(cuda):
        stream = torch.cuda.current_stream(cuda).cuda_stream
        rc = fn(dst.data_ptr(), dst.stride(0) * size, src.data_ptr(), src.stride(0) * size, dst[0].numel() * size,
                dst.shape[0], HOST_TO_DEVICE if kinds[0] == "cuda" else DEVICE_TO_HOST, stream)
    if rc != 0:  # cleared from the runtime's error state by cuda_runtime: torch's next op does not see it
        _strided.give_up(f"cudaMemcpy2DAsync returned error {rc}")
        return False
    return True


class CudaCopies:
    """Copies on one side stream. The compute stream waits on an event per layer (never on the whole side stream
    mid-forward), the side stream on the compute stream before it overwrites what compute may still read."""

    def __init__(self, device: torch.device):
        self.device = device
        self.side = torch.cuda.Stream(device)

    def after_compute(self) -> None:
        """Side-stream work issued from now on starts after everything queued on the compute stream so far."""
        self.side.wait_stream(torch.cuda.current_stream(self.device))

    def on_side(self) -> AbstractContextManager:
        return torch.cuda.stream(self.side)

    def mark(self) -> torch.cuda.Event:
        """An event after the side-stream work issued so far."""
        done = torch.cuda.Event()
        done.record(self.side)
        return done

    def wait(self, done: torch.cuda.Event | None) -> None:
        """The compute stream's next work starts after `done`."""
        if done is not None:
            torch.cuda.current_stream(self.device).wait_event(done)

    def join(self) -> torch.cuda.Event:
        """The compute stream waits for all side work; returns an event the host can wait on for all of it."""
        compute = torch.cuda.current_stream(self.device)
        compute.wait_stream(self.side)
        done = torch.cuda.Event()
        done.record(compute)
        return done


class InlineCopies:
    """CudaCopies' protocol where copies complete as issued (no streams, no events)."""

    def after_compute(self) -> None:
        pass

    def on_side(self) -> AbstractContextManager:
        return nullcontext()

    def mark(self) -> None:
        return None

    def wait(self, done: None) -> None:
        pass

    def join(self) -> None:
        return None
