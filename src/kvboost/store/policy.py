"""LFU with dynamic aging (LFU-DA), the memory tier's eviction order: priority = age floor + hits, the
floor rising to each victim's; ties evict the deepest, then stalest entry. A lazy-deletion heap: O(log n) evictions."""
from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class _Rank:
    depth: int  # the entry's start position: deeper entries go first among equals
    hits: int
    priority: float
    last_tick: int


class LfuAging:
    """Eviction order over keys; not thread-safe (its owner holds its own lock)."""

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
