"""In-process tier: byte budget, frequency-and-recency-aware eviction, parent/content indexes."""
from __future__ import annotations

import heapq
import threading
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

from .base import ChunkMeta, ChunkRecord, TierStats, discard_member


class Codec(Protocol):
    """Turns a record into a payload (its `nbytes` charged to the budget) and back: quantizing, moving to the host."""

    def encode(self, record: ChunkRecord) -> object: ...

    def decode(self, payload: object) -> ChunkRecord: ...


@dataclass
class _Entry:
    meta: ChunkMeta
    payload: object
    nbytes: int


class MemoryStore:
    """A byte budget under LFU with dynamic aging (LfuAging below). A parent is touched with its children, so eviction
    takes the tails of chains first."""

    name = "memory"

    def __init__(self, budget_bytes: int, max_entries: int | None = None, codec: Codec | None = None,
                 on_evict: Callable[[ChunkRecord], None] | None = None):
        self.budget_bytes = int(budget_bytes)
        self.max_entries = max_entries
        self.codec = codec
        self.on_evict = on_evict  # the tiered store spills evicted chunks to the next tier here
        # Told of every change, under the store's lock (keep it cheap): ("stored" | "removed", meta) and
        # ("cleared", None). The KV-event publisher (server/kv_events.py) listens here.
        self.watch: Callable[[str, ChunkMeta | None], None] | None = None
        self._entries: dict[str, _Entry] = {}
        self._children: dict[str | None, set[str]] = defaultdict(set)
        self._by_content: dict[str, set[str]] = defaultdict(set)
        self._span_members: dict[int, set[str]] = {}  # id(span) -> the keys of its records stored here
        self._bytes = 0
        self._policy = LfuAging()
        self._lock = threading.RLock()
        self._stats = TierStats(self.name, budget_bytes=self.budget_bytes)

    # ---- reads -------------------------------------------------------------------------------
    def get(self, key: str) -> ChunkRecord | None:
        payload = self.get_payload(key)
        return None if payload is None else self._decode(payload)

    def get_payload(self, key: str) -> object | None:
        """What get() decodes (the codec's form of the record), counted and touched as get() is."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self._stats.misses += 1
                return None
            self._policy.touch(key)
            self._stats.hits += 1
            return entry.payload

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._entries

    def children(self, parent_key: str | None) -> list[ChunkMeta]:
        with self._lock:
            return [self._entries[k].meta for k in self._children.get(parent_key, ()) if k in self._entries]

    def by_content(self, content_key: str) -> list[ChunkMeta]:
        with self._lock:
            return [self._entries[k].meta for k in self._by_content.get(content_key, ()) if k in self._entries]

    # ---- writes ------------------------------------------------------------------------------
    def put(self, record: ChunkRecord) -> bool:
        with self._lock:
            if record.key in self._entries:  # stored: a use, and no encoding (a quantization, a copy) for nothing
                self._policy.touch(record.key)
                return True
        payload = self.codec.encode(record) if self.codec else record
        nbytes = payload.nbytes
        if nbytes > self.budget_bytes:
            return False
        with self._lock:
            if record.key in self._entries:
                self._policy.touch(record.key)
                return True
            self._entries[record.key] = _Entry(record.meta(), payload, nbytes)
            self._policy.add(record.key, depth=record.start)
            self._children[record.parent_key].add(record.key)
            self._by_content[record.content_key].add(record.key)
            if isinstance(payload, ChunkRecord) and payload.span is not None:
                self._span_members.setdefault(id(payload.span), set()).add(record.key)
            self._bytes += nbytes
            evicted = self._evict_over_budget(protect=record.key)
            if self.watch is not None and record.key in self._entries:
                self.watch("stored", self._entries[record.key].meta)
        if self.on_evict:
            for victim in evicted:
                self.on_evict(victim)
        return record.key in self._entries

    def metas(self) -> list[ChunkMeta]:
        """What every stored chunk is (no K/V is decoded): a snapshot, in insertion order."""
        with self._lock:
            return [e.meta for e in self._entries.values()]

    def delete(self, key: str) -> None:
        with self._lock:
            self._remove(key)

    def clear(self) -> None:
        with self._lock:
            for table in (self._entries, self._children, self._by_content, self._span_members):
                table.clear()
            self._bytes = 0
            self._policy.reset()
            if self.watch is not None:
                self.watch("cleared", None)  # one "cleared", not a "removed" per chunk

    def stats(self) -> TierStats:
        with self._lock:
            return replace(self._stats, entries=len(self._entries), bytes=self._bytes)

    # ---- internals ---------------------------------------------------------------------------
    def _evict_over_budget(self, protect: str) -> list[ChunkRecord]:
        evicted: list[ChunkRecord] = []

        def evict(key: str) -> bool:
            if key == protect:
                return False
            if self.on_evict:
                evicted.append(self._decode(self._entries[key].payload))
            self._remove(key)
            self._stats.evictions += 1
            return True

        self._policy.evict_while(lambda: self._bytes > self.budget_bytes or (
            self.max_entries is not None and len(self._entries) > self.max_entries), evict)
        return evicted

    def _remove(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return
        span = entry.payload.span if isinstance(entry.payload, ChunkRecord) else None
        if span is not None:
            # The span's memory lives while any record views it: the ones left get memory of their own, so what the
            # budget counts is what is held.
            members = self._span_members.pop(id(span), set())
            members.discard(key)
            for other in members:
                kept = self._entries[other]
                kept.payload = kept.payload.standalone()
        self._policy.remove(key)
        self._bytes -= entry.nbytes
        discard_member(self._children, entry.meta.parent_key, key)
        discard_member(self._by_content, entry.meta.content_key, key)
        if self.watch is not None:
            self.watch("removed", entry.meta)

    def _decode(self, payload: object) -> ChunkRecord:
        return self.codec.decode(payload) if self.codec else payload  # type: ignore[return-value]


@dataclass
class _Rank:
    depth: int  # the entry's start position: deeper entries go first among equals
    hits: int
    priority: float
    last_tick: int


class LfuAging:
    """LFU with dynamic aging (LFU-DA), the memory tier's eviction order: priority = age floor + hits, the floor rising
    to each victim's; ties evict the deepest, then stalest entry. A lazy-deletion heap: O(log n) evictions. Not
    thread-safe (its owner holds its own lock)."""

    def __init__(self) -> None:
        self._ranks: dict[str, _Rank] = {}
        # (priority, -depth, last_tick, key), first victim on top; an entry with an outdated tick is stale, skipped.
        self._heap: list[tuple[float, int, int, str]] = []
        self._age_floor = 0.0
        self._tick = 0

    def __len__(self) -> int:
        return len(self._ranks)

    def add(self, key: str, depth: int) -> None:
        """A new entry starts at the age floor with no hits (re-adding a known key touches it)."""
        if key in self._ranks:
            self.touch(key)
            return
        self._tick += 1
        rank = _Rank(depth, 0, self._age_floor, self._tick)
        self._ranks[key] = rank
        self._push(key, rank)

    def touch(self, key: str) -> None:
        rank = self._ranks.get(key)
        if rank is None:
            return
        self._tick += 1
        rank.hits += 1
        rank.priority = self._age_floor + rank.hits
        rank.last_tick = self._tick
        self._push(key, rank)

    def remove(self, key: str) -> None:
        """Forget `key` without counting it as an eviction (a delete): the age floor stays."""
        self._ranks.pop(key, None)

    def reset(self) -> None:
        self._ranks.clear()
        self._heap.clear()
        self._age_floor = 0.0

    def evict_while(self, over_budget: Callable[[], bool], evict: Callable[[str], bool]) -> list[str]:
        """Offer keys to `evict` (True: dropped) in order while `over_budget()`; returns the keys evicted."""
        done: list[str] = []
        kept: list[tuple[float, int, int, str]] = []
        while self._heap and over_budget():
            entry = heapq.heappop(self._heap)
            key = entry[3]
            rank = self._ranks.get(key)
            if rank is None or rank.last_tick != entry[2]:
                continue  # stale: touched (a newer entry exists) or gone
            if evict(key):  # evict may already have called remove(key): rank is kept here
                self._ranks.pop(key, None)
                self._age_floor = max(self._age_floor, rank.priority)
                done.append(key)
            else:
                kept.append(entry)
        for entry in kept:
            heapq.heappush(self._heap, entry)
        return done

    def _push(self, key: str, rank: _Rank) -> None:
        heapq.heappush(self._heap, (rank.priority, -rank.depth, rank.last_tick, key))
        if len(self._heap) > 2 * len(self._ranks) + 64:  # mostly stale entries (many touches): rebuild
            self._heap = [(r.priority, -r.depth, r.last_tick, k) for k, r in self._ranks.items()]
            heapq.heapify(self._heap)
