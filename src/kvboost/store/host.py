"""The host tier: stored chunks the device tier evicts move to host memory instead of being dropped.

    device tier (TieredStore.memory, a byte budget on the model's device) evicts its coldest chunk
        -> HostStore.put(record): one copy into one host allocation (store/host_pack.py), page-locked on CUDA
    HostStore evicts its coldest chunk (its own budget)
        -> the disk tier, through the write-behind queue (as the memory tier's evictions go without a host tier)
    a get() of a host chunk
        -> HostStore.fetch(key): the host record, and its copy back on the device (one copy) that the tiered store
           promotes into the device tier when it fits there; the host copy then goes (a key lives in one of them)

A HostStore is a MemoryStore (same budget, LFU-with-aging order, parent and content indexes) whose codec is the move:
encode copies a record to the host, decode is the record over host memory. A quantized device tier's records arrive
as their quantized payloads and stay so here (2-4x more chunks in the same bytes, less to copy either way, and the
record that comes back is bit for bit the one the device held: nothing is quantized twice).

A move that fails (no host memory, a failed copy) is counted in `failures` and keeps nothing here: the chunk goes on
as if this tier were not there (to disk when it takes overflow, else dropped), and is recomputed on its next use at
worst; a request never fails for it.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from .base import ChunkRecord, TierStats
from .host_pack import HostMoveError, HostPayload, host_nbytes, move_to_host
from .memory import MemoryStore

log = logging.getLogger("kvboost.store.host")


class HostCodec:
    """MemoryStore Codec of the host tier: encode moves a record into host memory, decode is the record over it.

    pin: page-lock the host copies (on CUDA: copies out become DMA, enqueued together); where page-locking is
    refused the copy is pageable, counted in `pageable_moves`, and `unpinned_reason` says why.
    """

    def __init__(self, pin: bool):
        self.pin = pin
        self._lock = threading.Lock()
        self._offloaded = 0
        self._pageable = 0
        self._unpinned_reason: str | None = None
        self._failures: dict[str, int] = {}

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

    def nbytes(self, payload: HostPayload) -> int:
        return payload.nbytes

    def failed(self, reason: str, detail: str = "") -> None:
        with self._lock:
            first = reason not in self._failures
            self._failures[reason] = self._failures.get(reason, 0) + 1
        if first:  # once per reason: the counts are in cache_stats()
            log.warning("kvboost host tier: a move failed (%s), the chunk was not kept there (logged once; counted "
                        "in cache_stats()['tiers']['host']['failures'])", detail or reason)

    def stats(self) -> dict:
        with self._lock:
            return {"pinned": self.pin and self._pageable == 0, "unpinned_reason": self._unpinned_reason,
                    "pageable_moves": self._pageable, "offloaded": self._offloaded, "failures": dict(self._failures)}


class HostStore(MemoryStore):
    """A MemoryStore of `budget_bytes` of host memory holding records moved off the device (see the module doc).

    Stats (cache_stats()["tiers"]["host"]): the MemoryStore's (entries, bytes, hits, misses, evictions to the tier
    below), `promotions` (set by the tiered store: hits moved back to the device tier), and the moves': `offloaded`
    (records moved in), `failures` (reason -> moves that kept nothing: alloc, copy_to_host, copy_to_device),
    `pinned` (page-locking asked for and never refused), `unpinned_reason`, `pageable_moves`.
    """

    name = "host"

    def __init__(self, budget_bytes: int, pin: bool = False,
                 on_evict: Callable[[ChunkRecord], None] | None = None):
        self.mover = HostCodec(pin)
        super().__init__(budget_bytes, codec=self.mover, on_evict=on_evict)

    def put(self, record: ChunkRecord) -> bool:
        """Move `record` here (a copy: the caller's stays valid). False when it is larger than the budget (nothing
        copied) or the move failed (counted)."""
        if not self.contains(record.key) and host_nbytes(record) > self.budget_bytes:
            return False
        try:
            return super().put(record)
        except HostMoveError:
            return False

    def fetch(self, key: str, copy_back_bytes: int) -> tuple[ChunkRecord, ChunkRecord | None] | None:
        """A get() (counted, touched) that also copies the record back to the device it came from when it weighs
        at most copy_back_bytes there: (the host record, the device copy or None). None when the key is not here.
        The host keeps its copy: the caller deletes it once the device tier holds the key."""
        payload = self.get_payload(key)
        if payload is None:
            return None
        device = None
        if payload.record_nbytes <= copy_back_bytes:
            try:
                device = payload.to_device()
            except HostMoveError as exc:  # no device memory for it: served from the host this time
                self.mover.failed(exc.reason, str(exc))
        return payload.host_record(), device

    def stats(self) -> TierStats:
        s = super().stats()
        s.extra = {**s.extra, **self.mover.stats()}  # (a new dict: the copy's extra is still the tier's own)
        return s
