"""Write-behind for the slow tiers (disk, Redis): one background thread per store drains a byte-bounded queue
(a write that does not fit is dropped, counted). Queued records stay readable; deletes queue as tombstones."""
from __future__ import annotations

import atexit
import logging
import os
import threading
import weakref
from collections import defaultdict
from dataclasses import dataclass

from .base import ChunkMeta, ChunkRecord, ChunkStore, TierHealth, discard_member

log = logging.getLogger("kvboost.store.writeback")

DEFAULT_QUEUE_BYTES = 256 * 1024**2
DEFAULT_FLUSH_TIMEOUT_S = 10.0
_TOMBSTONE_BYTES = 1024  # what a queued delete is charged against the byte bound
_IDLE_EXIT_S = 2.0  # an idle writer thread exits; the next put starts another


@dataclass
class _Op:
    """One key's pending work: a put of `record` (None: a delete) into `tiers`."""

    key: str
    record: ChunkRecord | None
    tiers: list[ChunkStore]
    nbytes: int
    meta: ChunkMeta | None = None


class WriteBehind:
    def __init__(self, max_bytes: int = DEFAULT_QUEUE_BYTES, flush_timeout_s: float = DEFAULT_FLUSH_TIMEOUT_S,
                 targets: frozenset[str] = frozenset()):
        self.max_bytes = int(max_bytes)
        self.flush_timeout_s = float(flush_timeout_s)
        self.targets = targets  # what this queue writes to ("disk:/abs/dir", "redis:url"): see flush_targets
        self._init_state()
        self._closed = False
        self._dropped: dict[str, TierHealth] = {}  # tier name -> the writes this queue itself dropped
        self._written: dict[str, int] = defaultdict(int)
        self._failed: dict[str, int] = defaultdict(int)
        _LIVE.add(self)

    def _init_state(self) -> None:
        self._cond = threading.Condition()
        self._ops: dict[str, _Op] = {}  # insertion order is the FIFO
        self._by_parent: dict[str | None, set[str]] = defaultdict(set)
        self._by_content: dict[str, set[str]] = defaultdict(set)
        self._bytes = 0
        self._inflight: _Op | None = None
        self._thread: threading.Thread | None = None

    # ---- producers (request path: never blocks on a tier) --------------------------------------
    def submit(self, record: ChunkRecord, tiers: list[ChunkStore]) -> bool:
        """Queue a put of record into tiers; False (and counted per tier) when it had to be dropped."""
        return self._enqueue(_Op(record.key, record, list(tiers), record.nbytes, record.meta()))

    def submit_delete(self, key: str, tiers: list[ChunkStore]) -> bool:
        return self._enqueue(_Op(key, None, list(tiers), _TOMBSTONE_BYTES))

    def _enqueue(self, op: _Op) -> bool:
        if not op.tiers:
            return False
        with self._cond:
            if self._closed:
                reason = "closed"
            else:
                old = self._ops.get(op.key)
                if old is not None and old.record is not None and op.record is not None:
                    old.tiers += [t for t in op.tiers if t not in old.tiers]  # same K/V: one write per tier
                    return True
                freed = old.nbytes if old is not None else 0
                if self._ops and self._bytes - freed + op.nbytes > self.max_bytes:
                    reason = "queue_full"  # (an empty queue takes even a record larger than the bound)
                else:
                    if old is not None:
                        self._remove(old)  # a delete replaces a pending put of the key, and vice versa
                    self._add(op)
                    if self._thread is None:
                        self._thread = threading.Thread(target=self._drain, name="kvboost-store-writer", daemon=True)
                        self._thread.start()
                    return True
        for tier in op.tiers:
            self._drop(tier.name, reason)
        return False

    def cancel_all(self) -> None:
        """Forget everything pending and wait (bounded) for the write in flight, e.g. before a clear()."""
        with self._cond:
            for op in list(self._ops.values()):
                self._remove(op)
        self.flush(self.flush_timeout_s)

    # ---- readers: a queued chunk is still a cached chunk ----------------------------------------
    def lookup(self, key: str) -> tuple[bool, ChunkRecord | None]:
        """(pending, record): pending with record None means a delete is queued (the key reads as absent)."""
        with self._cond:
            op = self._ops.get(key)
            if op is None and self._inflight is not None and self._inflight.key == key:
                op = self._inflight  # being written right now: not on the tier yet
            return (op is not None, op.record if op is not None else None)

    def deleted(self) -> set[str]:
        with self._cond:
            return {k for k, op in self._ops.items() if op.record is None}

    def children(self, parent_key: str | None) -> list[ChunkMeta]:
        return self._metas(self._by_parent, "parent_key", parent_key)

    def by_content(self, content_key: str) -> list[ChunkMeta]:
        return self._metas(self._by_content, "content_key", content_key)

    def _metas(self, index: dict, attr: str, value: str | None) -> list[ChunkMeta]:
        with self._cond:
            metas = [self._ops[k].meta for k in index.get(value, ())]
            op = self._inflight
            if op is not None and op.meta is not None and getattr(op.meta, attr) == value:
                metas.append(op.meta)
            return metas

    # ---- waiting --------------------------------------------------------------------------------
    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued write has landed (or failed); False if timeout_s passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._ops and self._inflight is None, timeout_s)

    def close(self, timeout_s: float | None = None) -> bool:
        """Flush (bounded by timeout_s, default flush_timeout_s), then refuse new writes; what is left is dropped."""
        done = self.flush(self.flush_timeout_s if timeout_s is None else timeout_s)
        with self._cond:
            self._closed = True
            left = list(self._ops.values())
            for op in left:
                self._remove(op)
        for op in left:
            for tier in op.tiers:
                self._drop(tier.name, "closed")
        return done

    def stats(self, tier_name: str) -> dict:
        with self._cond:
            pending = sum(1 for op in self._ops.values() if any(t.name == tier_name for t in op.tiers))
            return {"queued_writes": pending, "written_behind": self._written.get(tier_name, 0),
                    "failed_behind": self._failed.get(tier_name, 0),
                    "queue_dropped": self._dropped[tier_name].as_extra()["dropped_writes"]
                    if tier_name in self._dropped else {}}

    # ---- the writer thread ------------------------------------------------------------------------
    def _drain(self) -> None:
        while True:
            with self._cond:
                if not self._ops:
                    self._cond.wait(_IDLE_EXIT_S)
                    if not self._ops:
                        self._thread = None  # idle: exit (stores that are dropped do not keep threads)
                        return
                op = next(iter(self._ops.values()))
                self._remove(op)
                self._inflight = op
            try:
                self._apply(op)
            finally:
                with self._cond:
                    self._inflight = None
                    self._cond.notify_all()

    def _apply(self, op: _Op) -> None:
        for tier in op.tiers:
            try:
                if op.record is None:
                    tier.delete(op.key)
                    ok = True
                else:
                    ok = tier.put(op.record)
            except Exception as exc:  # tiers count their own failures; this is a last line of defence
                log.debug("write-behind to %s failed: %r", tier.name, exc)
                ok = False
            with self._cond:  # (a failure: the tier says why, in its own dropped_writes/events)
                (self._written if ok else self._failed)[tier.name] += 1

    # ---- internals (under self._cond) ---------------------------------------------------------------
    def _add(self, op: _Op) -> None:
        self._ops[op.key] = op
        self._bytes += op.nbytes
        if op.meta is not None:
            self._by_parent[op.meta.parent_key].add(op.key)
            self._by_content[op.meta.content_key].add(op.key)

    def _remove(self, op: _Op) -> None:
        if self._ops.get(op.key) is not op:
            return
        del self._ops[op.key]
        self._bytes -= op.nbytes
        if op.meta is not None:
            discard_member(self._by_parent, op.meta.parent_key, op.key)
            discard_member(self._by_content, op.meta.content_key, op.key)

    def _drop(self, tier: str, reason: str) -> None:
        with self._cond:
            health = self._dropped.setdefault(tier, TierHealth(tier))
        health.dropped(reason, f"the write-behind queue ({self.max_bytes >> 20} MiB) is "
                       + ("full" if reason == "queue_full" else "closed"))


_LIVE: weakref.WeakSet[WriteBehind] = weakref.WeakSet()


def flush_targets(targets: frozenset[str], timeout_s: float = DEFAULT_FLUSH_TIMEOUT_S) -> None:
    """Let a store opened in this process see what other live stores here queued for the same disk/Redis."""
    for queue in list(_LIVE):
        if queue.targets & targets:
            queue.flush(timeout_s)


def _after_fork_in_child() -> None:
    # The writer thread does not survive fork() and its lock may be held: the child starts empty.
    for queue in list(_LIVE):
        queue._init_state()


os.register_at_fork(after_in_child=_after_fork_in_child)


@atexit.register
def _flush_at_exit() -> None:
    # Daemon threads still run while atexit hooks do, so queued chunks reach disk before the process goes.
    for queue in list(_LIVE):
        if not queue.flush(queue.flush_timeout_s):
            log.warning("kvboost: exiting with chunks still queued for the slow tiers (flush timed out)")
