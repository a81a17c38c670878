"""The host tier: chunks the device tier evicts move to host memory (one allocation each, page-locked on CUDA) and its
own evictions go on to disk. A key lives in one of the two; a failed move is counted and keeps nothing."""
from __future__ import annotations

import threading

from .base import ChunkRecord, TierHealth, TierStats
from .host_pack import HostMoveError, HostPayload, host_nbytes, move_to_host
from .memory import MemoryStore


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
        if not self.contains(record.key) and host_nbytes(record) > self.budget_bytes:
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
