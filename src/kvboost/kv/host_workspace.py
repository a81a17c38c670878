"""One sequence's K/V in host memory, for contexts longer than the device holds (device_kv_max_tokens), with the
workspace surface the KV manager uses; kv/host_stream.py brings each layer to the device as it runs. Copies between
the host buffers and the device: [kv_heads, n, d] ranges with heads `capacity * d` apart go as one cudaMemcpy2DAsync
(torch's copy_ would gather them into pageable memory first), else per head."""
from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch

from .pinned import HOST_TO_DEVICE, cuda_runtime, pinned_empty
from .workspace import KVWorkspace, LayerShape, concat_into, grown_capacity


@dataclass
class HostStreamStats:
    forwards: int = 0  # forwards completed
    bytes_to_device: int = 0  # K/V of earlier positions brought from host memory (staged forwards)
    bytes_to_host: int = 0  # the steps' own K/V written back to host memory (staged forwards)


def bytes_per_position(shapes: Sequence[LayerShape], dtype: torch.dtype) -> int:
    """K and V of one position, every layer."""
    return sum(s.kv_heads * (s.head_dim_k + s.head_dim_v) for s in shapes) * dtype.itemsize


class DeviceResident:
    """Positions [0, filled) of every layer kept on the device, allocated at the first staged forward."""

    def __init__(self, shapes: list[LayerShape], dtype: torch.dtype, device: torch.device, budget_bytes: int):
        self.shapes, self.dtype, self.device = shapes, dtype, device
        self.capacity = budget_bytes // bytes_per_position(shapes, dtype)
        self.filled = 0
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def buffers(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.keys:
            for s in self.shapes:
                for bufs, d in ((self.keys, s.head_dim_k), (self.values, s.head_dim_v)):
                    bufs.append(torch.empty(1, s.kv_heads, self.capacity, d, dtype=self.dtype, device=self.device))
        return self.keys[layer_idx], self.values[layer_idx]

    def invalidate_from(self, position: int) -> None:
        """The host's K/V from `position` on changed: the device copy of those positions is stale."""
        self.filled = min(self.filled, position)


class Scratch:
    """Two pairs of device K/V buffers that layers take in turn (layer i: pair i % 2), so layer i + 1 is copied in while
    layer i's attention reads the other; grown as forwards need."""

    def __init__(self, shapes: list[LayerShape], dtype: torch.dtype, device: torch.device):
        self.shapes, self.dtype, self.device = shapes, dtype, device
        self.columns = 0
        self.flat: list[tuple[torch.Tensor, torch.Tensor]] = []

    def ensure(self, n: int) -> None:
        """Room for n positions. Called before a forward's first copy (no copy in flight reads the old buffers)."""
        if n > self.columns:
            self.columns = grown_capacity(n, self.columns, None)
            k_width = max(s.kv_heads * s.head_dim_k for s in self.shapes)
            v_width = max(s.kv_heads * s.head_dim_v for s in self.shapes)
            self.flat = [(torch.empty(self.columns * k_width, dtype=self.dtype, device=self.device),
                          torch.empty(self.columns * v_width, dtype=self.dtype, device=self.device)) for _ in range(2)]

    def views(self, layer_idx: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer layer_idx's K and V [1, kv_heads, n, d] (strided: a head is `columns` positions apart)."""
        s, (k, v) = self.shapes[layer_idx], self.flat[layer_idx % 2]
        cols = self.columns
        keys = k[:s.kv_heads * cols * s.head_dim_k].view(1, s.kv_heads, cols, s.head_dim_k)
        values = v[:s.kv_heads * cols * s.head_dim_v].view(1, s.kv_heads, cols, s.head_dim_v)
        return keys[:, :, :n], values[:, :, :n]


class HostWorkspace:
    """Per-layer K/V [1, kv_heads, capacity, d] of one sequence in host memory. staged: None stages through device
    buffers unless the compute device is the host; True also on a CPU (tests); False: attention reads host memory."""

    batch_size = 1
    base = 0  # column c holds position c (KVWorkspace's base: a host workspace never skips a shared prefix)

    def __init__(self, shapes: list[LayerShape], dtype: torch.dtype, compute_device: torch.device | str,
                 resident_bytes: int = 0, staged: bool | None = None, max_positions: int | None = None):
        self.shapes, self.dtype = shapes, dtype
        self.device = torch.device("cpu")  # where the buffers live (what place() and read() copy to and from)
        self.compute_device = torch.device(compute_device)
        self.staged = self.compute_device.type != "cpu" if staged is None else staged
        if not self.staged and self.compute_device.type != "cpu":
            raise ValueError(f"a model on {self.compute_device} cannot read K/V in host memory: its forwards must be "
                             "staged through device buffers (staged=None or True)")
        self.max_positions = max_positions
        self.capacity = 0
        self.length = 0
        self.pinned = False
        self.pageable_reason: str | None = None  # why the buffers are not page-locked (CUDA), if they are not
        self.stats = HostStreamStats()
        self.copies: CudaCopies | InlineCopies | None = None
        if self.staged:
            self.copies = CudaCopies(self.compute_device) if self.compute_device.type == "cuda" else InlineCopies()
        self.scratch = Scratch(shapes, dtype, self.compute_device) if self.staged else None
        self.resident = (DeviceResident(shapes, dtype, self.compute_device, resident_bytes)
                         if self.staged and resident_bytes > 0 else None)
        self.pending: torch.cuda.Event | None = None  # copies to/from the buffers still in flight (CUDA)
        self._k: list[torch.Tensor] = []
        self._v: list[torch.Tensor] = []

    # ---- buffers -------------------------------------------------------------------------------------
    def _host_empty(self, shape: tuple[int, ...]) -> torch.Tensor:
        if self.compute_device.type != "cuda":
            return torch.empty(shape, dtype=self.dtype)
        tensor, why_not = pinned_empty(shape, self.dtype)
        if why_not is not None and why_not != "empty" and self.pageable_reason is None:
            self.pageable_reason = why_not
        return tensor

    def _allocate(self, capacity: int, keep: int) -> None:
        self.sync()
        keep = min(keep, self.capacity)
        self.pageable_reason = None
        new_k, new_v = [], []
        for i, s in enumerate(self.shapes):
            for new, old, d in ((new_k, self._k, s.head_dim_k), (new_v, self._v, s.head_dim_v)):
                t = self._host_empty((1, s.kv_heads, capacity, d))
                if keep:
                    t[:, :, :keep].copy_(old[i][:, :, :keep])
                new.append(t)
        self._k, self._v, self.capacity = new_k, new_v, capacity
        self.length = min(self.length, keep)
        if self.resident is not None:
            self.resident.invalidate_from(keep)
        self.pinned = self.compute_device.type == "cuda" and capacity > 0 and self.pageable_reason is None

    def ensure_capacity(self, needed: int, keep: int | None = None) -> None:
        """Room for positions [0, needed); positions [0, keep) (default: all held) keep their K/V on growth."""
        if needed > self.capacity:
            if self.max_positions and needed > self.max_positions:
                raise ValueError(f"{needed} positions exceed this host workspace's {self.max_positions}")
            self._allocate(grown_capacity(needed, self.capacity, self.max_positions),
                           self.capacity if keep is None else keep)

    def buffers(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer layer_idx's host K and V [1, kv_heads, capacity, d]."""
        return self._k[layer_idx], self._v[layer_idx]

    def set_length(self, length: int) -> None:
        """The sequence holds positions [0, length) (a rollback, or positions placed from chunks)."""
        if not 0 <= length <= self.capacity:
            raise ValueError(f"length {length} is outside this host workspace's {self.capacity} positions")
        self.length = length
        if self.resident is not None:
            self.resident.invalidate_from(length)

    def sync(self) -> None:
        """Wait for copies in flight to or from the host buffers (before the CPU reads or writes them)."""
        if self.pending is not None:
            self.pending.synchronize()
            self.pending = None

    def release(self) -> None:
        """Give every buffer back (host, and the device's scratch and resident copies)."""
        self.sync()
        self._k, self._v, self.capacity, self.length = [], [], 0, 0
        if self.scratch is not None:
            self.scratch = Scratch(self.shapes, self.dtype, self.compute_device)
        if self.resident is not None:
            self.resident.keys, self.resident.values, self.resident.filled = [], [], 0

    @property
    def nbytes(self) -> int:
        """Host memory held."""
        return sum(t.numel() * t.element_size() for t in self._k + self._v)

    # ---- contents (KVCacheManager's workspace surface) ---------------------------------------------------
    def write_layer(self, layer_idx: int, keys: list[torch.Tensor], values: list[torch.Tensor], start: int,
                    row: int | None = None) -> None:
        """Consecutive pieces of one layer's K/V ([kv_heads, n_i, d] each, any device) to positions start..."""
        _check_row(row)
        n = sum(p.shape[-2] for p in keys)
        if n == 0:
            return
        if start + n > self.capacity:
            raise ValueError(f"positions [{start}, {start + n}) exceed this host workspace's {self.capacity}")
        self.sync()
        k_buf, v_buf = self.buffers(layer_idx)
        concat_into(keys, k_buf[0, :, start:start + n])
        concat_into(values, v_buf[0, :, start:start + n])
        if self.resident is not None:
            self.resident.invalidate_from(start)

    write = KVWorkspace.write

    def read(self, start: int, end: int, row: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Owned host copies [kv_heads, end - start, d] of positions [start, end), every layer."""
        _check_row(row)
        if end > self.capacity:
            raise ValueError(f"positions [{start}, {end}) exceed this host workspace's {self.capacity}")
        self.sync()
        return ([k[0, :, start:end].clone() for k in self._k], [v[0, :, start:end].clone() for v in self._v])


def _check_row(row: int | None) -> None:
    if row not in (None, 0):
        raise ValueError(f"a host workspace holds one sequence (row 0); got row {row}")


# ---- copies between host and device ------------------------------------------------------------------
DEVICE_TO_HOST = 2  # cudaMemcpyDeviceToHost


class _StridedCopy:
    """cudaMemcpy2DAsync through torch's runtime, looked up once; given up (fn None: per-head copies) on an error. No
    lock: threads racing the first lookup get the same cached runtime."""

    fn = None
    status = "not tried"

    def get(self):
        if self.status == "not tried":
            try:
                self.fn = cuda_runtime().memcpy2d_async
                self.status = "one cudaMemcpy2DAsync per layer and K/V"
            except OSError as exc:
                self.status = f"one copy per head: {exc}"
        return self.fn


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
        _strided.fn, _strided.status = None, f"one copy per head: cudaMemcpy2DAsync returned error {rc}"
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
