"""The host tier: chunks the device tier evicts move to host memory and its own evictions go on to disk. A key lives in
one of the two; a failed move is counted and keeps nothing. A chunk's K/V moves into ONE host allocation (page-locking
costs per call; page-locked on CUDA), and back in one copy: full-precision records with alike layers as one [layers, 2,
kv_heads, n_tokens, head_dim] tensor, anything else as one byte buffer of aligned views. A failed allocation or copy
raises HostMoveError."""
from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..kv.pinned import ALIGN, byte_view, pinned_empty
from .base import ChunkMeta, ChunkRecord, TierHealth, TierStats
from .memory import MemoryStore
from .quant import Encoded, LazyQuantRecord, QuantRecord, QuantTensor


class HostMoveError(RuntimeError):
    """A record could not be moved: `reason` is what the host tier counts (alloc, copy_to_host, copy_to_device)."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass
class HostPayload:
    """One record in host memory, its tensors views of `buffer`; `source`: the device it came from."""

    meta: ChunkMeta
    buffer: torch.Tensor
    source: torch.device
    pinned: bool
    record: ChunkRecord | None = None
    quant: QuantRecord | None = None

    @property
    def nbytes(self) -> int:
        """Host memory held (the buffer, alignment included)."""
        return self.buffer.numel() * self.buffer.element_size()

    def host_record(self) -> ChunkRecord:
        """The record over host memory (a quantized one dequantizes lazily, like the quantized memory tier's)."""
        if self.quant is not None:
            return LazyQuantRecord(self.quant)  # a fresh one per use: its dequantized cache dies with the caller's
        return self.record

    def to_device(self) -> ChunkRecord:
        """The record on `source`, in one copy; blocking, as the host buffer may be freed on return."""
        try:
            moved = self.buffer.to(self.source)  # (on the CPU, the same memory: nothing to copy)
        except RuntimeError as exc:  # out of device memory
            raise HostMoveError("copy_to_device", str(exc)) from exc
        m = self.meta
        if self.quant is not None:
            return LazyQuantRecord(_map_quant(self.quant, _rebase(self.buffer, moved)))
        if self.record.packed is self.buffer:
            return ChunkRecord.from_packed(m, moved)
        rebase = _rebase(self.buffer, moved)
        return ChunkRecord.of(m, [rebase(k) for k in self.record.keys], [rebase(v) for v in self.record.values])


def move_to_host(record: ChunkRecord, pin: bool) -> tuple[HostPayload, str | None]:
    """(record copied into one host buffer, why it is not page-locked when `pin` asked for it, else None)."""
    meta = record.meta()
    if isinstance(record, LazyQuantRecord):  # keep the codec's payload: smaller, and exactly what the device held
        q = record.payload
        sources = [t for e in (*q.keys, *q.values) for t in _encoded_tensors(e)]  # (the order _map_quant visits)
        buffer, views, reason = _byte_buffer(sources, pin)
        it = iter(views)
        quant = _map_quant(q, lambda _t: next(it))
        payload = HostPayload(meta, buffer, sources[0].device, pin and reason is None, quant=quant)
        _copy(list(zip(views, sources)), payload.pinned)
        return payload, reason
    keys, values = list(record.keys), list(record.values)
    if keys[0].dim() == 3 and all(t.shape == keys[0].shape and t.dtype == keys[0].dtype for t in keys + values):
        heads, tokens, dim = keys[0].shape
        buffer, reason = allocate_host((len(keys), 2, heads, tokens, dim), keys[0].dtype, pin)
        host = ChunkRecord.from_packed(meta, buffer)
        packed = record.packed_view()
        pairs = [(buffer, packed)] if packed is not None else list(zip(host.keys + host.values, keys + values))
    else:
        buffer, views, reason = _byte_buffer(keys + values, pin)
        host = ChunkRecord.of(meta, views[:len(keys)], views[len(keys):])
        pairs = list(zip(views, keys + values))
    payload = HostPayload(meta, buffer, keys[0].device, pin and reason is None, record=host)
    _copy(pairs, payload.pinned)
    return payload, reason


def allocate_host(shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> tuple[torch.Tensor, str | None]:
    """An uninitialized host tensor and, when `pin` asked for page-locked memory and got pageable, why."""
    try:
        return pinned_empty(shape, dtype) if pin else (torch.empty(shape, dtype=dtype), None)
    except (RuntimeError, MemoryError) as exc:  # the host is out of memory: this record is not kept
        raise HostMoveError("alloc", str(exc)) from exc


# ---- internals ----------------------------------------------------------------------------------------------------
def _byte_buffer(tensors: list[torch.Tensor], pin: bool) -> tuple[torch.Tensor, list[torch.Tensor], str | None]:
    """One uint8 buffer and a view of it shaped like each tensor (each start aligned)."""
    offsets, total = [], 0
    for t in tensors:
        total = -(-total // ALIGN) * ALIGN
        offsets.append(total)
        total += t.numel() * t.element_size()
    buffer, reason = allocate_host((total,), torch.uint8, pin)
    return buffer, [byte_view(buffer, off, t) for off, t in zip(offsets, tensors)], reason


def _rebase(old: torch.Tensor, new: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """Maps a view of `old` to the view of `new` (a copy of it) at the same bytes."""
    flat = new.reshape(-1).view(torch.uint8)
    base = old.data_ptr()
    return lambda t: byte_view(flat, t.data_ptr() - base, t)


def _copy(pairs: list[tuple[torch.Tensor, torch.Tensor]], pinned: bool) -> None:
    """dst <- src for every pair: into page-locked memory from CUDA enqueued together and waited for once."""
    devices = {src.device for _, src in pairs}
    source = next(iter(devices))
    overlap = pinned and len(devices) == 1 and source.type == "cuda"
    try:
        for dst, src in pairs:
            dst.copy_(src, non_blocking=overlap)
        if overlap:
            torch.cuda.current_stream(source).synchronize()
    except RuntimeError as exc:  # a device error: nothing half-copied is kept
        raise HostMoveError("copy_to_host", str(exc)) from exc


def _map_quant(q: QuantRecord, fn: Callable[[torch.Tensor], torch.Tensor]) -> QuantRecord:
    """`q` with every tensor t replaced by fn(t), in a fixed order (keys, then values; data, scale, zero)."""
    return QuantRecord(q.meta, [_map_encoded(k, fn) for k in q.keys], [_map_encoded(v, fn) for v in q.values], q.bits)


def _encoded_tensors(e: Encoded) -> list[torch.Tensor]:
    return [e.data, e.scale, e.zero] if isinstance(e, QuantTensor) else [e]


def _map_encoded(e: Encoded, fn: Callable[[torch.Tensor], torch.Tensor]) -> Encoded:
    if isinstance(e, QuantTensor):
        return dataclasses.replace(e, data=fn(e.data), scale=fn(e.scale), zero=fn(e.zero))
    return fn(e)


class HostCodec:
    """MemoryStore Codec of the host tier: encode moves a record into host memory, decode is the record over it."""

    def __init__(self, pin: bool):
        self.pin = pin
        self._lock = threading.Lock()
        self._offloaded = 0
        self._pageable = 0
        self._unpinned_reason: str | None = None
        self.health = TierHealth("host")  # failed moves by reason, each logged once

    def encode(self, record: ChunkRecord) -> HostPayload:
        try:
            payload, reason = move_to_host(record, self.pin)
        except Exception as exc:  # whatever went wrong, the move keeps nothing and the request goes on
            failure = exc if isinstance(exc, HostMoveError) else HostMoveError("error", repr(exc))
            self.failed(failure.reason, str(failure))
            raise failure from exc
        with self._lock:
            self._offloaded += 1
            if reason is not None:
                self._pageable += 1
                self._unpinned_reason = reason
        return payload

    def decode(self, payload: HostPayload) -> ChunkRecord:
        return payload.host_record()

    def failed(self, reason: str, detail: str = "") -> None:
        self.health.event(reason, f"a move failed ({detail or reason}), the chunk was not kept there")

    def stats(self) -> dict:
        failures = self.health.as_extra()["events"]
        with self._lock:
            return {"pinned": self.pin and self._pageable == 0, "unpinned_reason": self._unpinned_reason,
                    "pageable_moves": self._pageable, "offloaded": self._offloaded, "failures": failures}


class HostStore(MemoryStore):
    """A MemoryStore of `budget_bytes` of host memory holding records moved off the device. Stats add `promotions`,
    `offloaded`, `failures` (reason -> count), `pinned`, `unpinned_reason` and `pageable_moves`."""

    name = "host"

    def __init__(self, budget_bytes: int, pin: bool = False):
        self.mover = HostCodec(pin)
        super().__init__(budget_bytes, codec=self.mover)

    def put(self, record: ChunkRecord) -> bool:
        """Move (copy) `record` here. False when larger than the budget or the move failed (counted)."""
        # About what the move takes (before alignment): the payload if quantized, else the K/V.
        nbytes = record.payload.nbytes if isinstance(record, LazyQuantRecord) else record.nbytes
        if not self.contains(record.key) and nbytes > self.budget_bytes:
            return False
        try:
            return super().put(record)
        except HostMoveError:
            return False

    def fetch(self, key: str, copy_back_bytes: int) -> tuple[ChunkRecord, ChunkRecord | None] | None:
        """A counted get(), with a device copy when it weighs <= copy_back_bytes: (host, device or None) or None."""
        payload = self.get_payload(key)
        if payload is None:
            return None
        device = None
        if (payload.quant or payload.record).nbytes <= copy_back_bytes:  # what a device tier charges for it
            try:
                device = payload.to_device()
            except HostMoveError as exc:  # no device memory for it: served from the host this time
                self.mover.failed(exc.reason, str(exc))
        return payload.host_record(), device

    def stats(self) -> TierStats:
        s = super().stats()
        s.extra = {**s.extra, **self.mover.stats()}  # (a new dict: the copy's extra is still the tier's own)
        return s
