"""Host-to-device copies of block runs: one cudaMemcpy2DAsync per run instead of one copy per block.

A streamed sequence (kv/layer_stream.py) brings, per layer and forward, one region of each of its host blocks to
the device. The host pool is block-major ([blocks, layers, 2, H, bs, d]: a block is one allocation), so layer l of
blocks b..b+k-1 is k equal rows `stride(0)` bytes apart: one strided copy for the DMA engine, but k copies through
torch (`copy_` of a non-contiguous host tensor first gathers it on the CPU). Measured on an H100 (Qwen2.5-3B
shape, 32k context, 24k positions streamed): ~6,800 block copies per decode step cost 118 ms of launches against
16 ms of bytes. The CUDA runtime that torch loaded has the strided copy (cudaMemcpy2DAsync); it is called through
ctypes (cuda_runtime.py). Its first use in a process is checked against per-block copies; a missing runtime, an
error code (cleared from the runtime's error state) or a mismatch keeps per-block copies (`status` says why) and
never changes a value.
"""
from __future__ import annotations

import threading

import torch

from .cuda_runtime import HOST_TO_DEVICE, cuda_runtime


class RowCopier:
    """copy_rows(dst, src): dst [k, ...] contiguous on a CUDA device <- src [k, ...] in pinned host memory, whose
    rows are each contiguous and `src.stride(0)` elements apart. Enqueued on the current stream."""

    def __init__(self, strided: bool = True) -> None:
        self._fn = None
        self._verified = False
        self._lock = threading.Lock()
        self.status = "one copy per block"
        if not strided:
            return
        try:
            self._fn = cuda_runtime().memcpy2d_async
            self.status = "one cudaMemcpy2DAsync per run of blocks"
        except OSError as exc:
            self.status = f"one copy per block: {exc}"

    @classmethod
    def per_row(cls) -> RowCopier:
        """A copier that always copies row by row (the staged path run without CUDA, in tests)."""
        return cls(strided=False)

    def copy_rows(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if not self._copy_2d(dst, src):
            for i in range(src.shape[0]):
                dst[i].copy_(src[i], non_blocking=True)

    def _copy_2d(self, dst: torch.Tensor, src: torch.Tensor) -> bool:
        if self._fn is None or src.shape[0] == 0 or not dst.is_contiguous() or not src[0].is_contiguous() \
                or not src.is_pinned() or dst.device.type != "cuda" or src.dtype != dst.dtype:
            return False
        width = dst[0].numel() * dst.element_size()
        stream = torch.cuda.current_stream(dst.device).cuda_stream
        rc = self._fn(dst.data_ptr(), width, src.data_ptr(), src.stride(0) * src.element_size(), width,
                      src.shape[0], HOST_TO_DEVICE, stream)
        if rc != 0:  # cleared from the runtime's error state (cuda_runtime.py): torch's next op must not see it
            self._give_up(f"cudaMemcpy2DAsync returned error {rc}")
            return False
        if not self._verified:
            self._verify(dst, src)
        return self._fn is not None

    def _verify(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Once per process: the strided copy's bytes must equal per-row copies' (else per-row copies from now on,
        and this copy is redone by the caller)."""
        with self._lock:
            if self._verified:
                return
            torch.cuda.current_stream(dst.device).synchronize()
            expected = torch.stack([row.to(dst.device) for row in src])
            if torch.equal(dst.reshape(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8)):  # bits
                self._verified = True
            else:
                self._give_up("cudaMemcpy2DAsync's bytes differed from per-block copies")

    def _give_up(self, reason: str) -> None:
        self._fn = None
        self.status = f"one copy per block: {reason}"


_copier: RowCopier | None = None
_copier_lock = threading.Lock()


def row_copier() -> RowCopier:
    """The process's copier (the runtime library is looked up once)."""
    global _copier
    with _copier_lock:
        if _copier is None:
            _copier = RowCopier()
        return _copier
