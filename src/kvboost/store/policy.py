"""LFU with dynamic aging (LFU-DA): the one eviction order shared by the memory tier and the block cache.

priority = age floor + hits. A system prompt hit on every request keeps climbing; a chunk that was popular long
ago is overtaken as the age floor rises with each eviction (the floor becomes the victim's priority). Among equal
priorities the deepest entry (a chain's tail: largest start) and then the stalest go first, so chains never lose
their heads while their tails remain.

The policy only orders keys; the owner decides what "over budget" means and which keys may not go (a block a
running sequence reads), and tells the policy what it evicted.

The order is a heap with lazy deletion (a touch pushes a fresh entry; stale ones are skipped when popped), so an
eviction costs O(log n) instead of sorting every key: a full cache of 5,000 chunks evicts on every put, and the
sort made a 235-chunk write-back cost 430 ms of bookkeeping (tests/store/test_policy.py checks the heap against
the sorted order).
"""
from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


@dataclass
class _Rank:
    depth: int  # the entry's start position: deeper entries go first among equals
    hits: int
    priority: float
    last_tick: int


class LfuAging(Generic[K]):
    """Eviction order over keys; not thread-safe (its owner holds its own lock)."""

    def __init__(self) -> None:
        self._ranks: dict[K, _Rank] = {}
        # (priority, -depth, last_tick, key): the first victim on top; an entry whose tick is not its key's
        # current one is stale (touched or removed since) and skipped.
        self._heap: list[tuple[float, int, int, K]] = []
        self._age_floor = 0.0
        self._tick = 0

    def __len__(self) -> int:
        return len(self._ranks)

    def __contains__(self, key: object) -> bool:
        return key in self._ranks

    def add(self, key: K, depth: int) -> None:
        """A new entry starts at the age floor with no hits (re-adding a known key touches it)."""
        if key in self._ranks:
            self.touch(key)
            return
        self._tick += 1
        rank = _Rank(depth, 0, self._age_floor, self._tick)
        self._ranks[key] = rank
        self._push(key, rank)

    def touch(self, key: K) -> None:
        rank = self._ranks.get(key)
        if rank is None:
            return
        self._tick += 1
        rank.hits += 1
        rank.priority = self._age_floor + rank.hits
        rank.last_tick = self._tick
        self._push(key, rank)

    def remove(self, key: K) -> None:
        """Forget `key` without counting it as an eviction (a delete): the age floor stays."""
        self._ranks.pop(key, None)

    def evicted(self, key: K) -> None:
        """`key` was evicted by its owner (outside evict_while): the age floor rises to its priority."""
        rank = self._ranks.pop(key, None)
        if rank is not None:
            self._age_floor = max(self._age_floor, rank.priority)

    def reset(self) -> None:
        self._ranks.clear()
        self._heap.clear()
        self._age_floor = 0.0

    def order(self) -> list[K]:
        """Every key, first victim first (a snapshot: the owner may evict while walking it)."""
        return sorted(self._ranks, key=lambda k: (self._ranks[k].priority, -self._ranks[k].depth,
                                                  self._ranks[k].last_tick))

    def evict_while(self, over_budget: Callable[[], bool], evict: Callable[[K], bool]) -> list[K]:
        """Offer keys to `evict` in order while `over_budget()`; `evict(key)` drops the owner's entry and returns
        True, or returns False to keep it (pinned, protected). Returns the keys evicted (the floor rose for each).
        Costs O(log n) per key offered: kept keys are offered once per call and go back in the heap after it."""
        done: list[K] = []
        kept: list[tuple[float, int, int, K]] = []
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

    def _push(self, key: K, rank: _Rank) -> None:
        heapq.heappush(self._heap, (rank.priority, -rank.depth, rank.last_tick, key))
        if len(self._heap) > 2 * len(self._ranks) + 64:  # mostly stale entries (many touches): rebuild
            self._heap = [(r.priority, -r.depth, r.last_tick, k) for k, r in self._ranks.items()]
            heapq.heapify(self._heap)
