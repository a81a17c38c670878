"""LFU with dynamic aging (LFU-DA): the one eviction order shared by the memory tier and the block cache.

priority = age floor + hits. A system prompt hit on every request keeps climbing; a chunk that was popular long
ago is overtaken as the age floor rises with each eviction (the floor becomes the victim's priority). Among equal
priorities the deepest entry (a chain's tail: largest start) and then the stalest go first, so chains never lose
their heads while their tails remain.

The policy only orders keys; the owner decides what "over budget" means and which keys may not go (a block a
running sequence reads), and tells the policy what it evicted.
"""
from __future__ import annotations

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
        self._ranks[key] = _Rank(depth, 0, self._age_floor, self._tick)

    def touch(self, key: K) -> None:
        rank = self._ranks.get(key)
        if rank is None:
            return
        self._tick += 1
        rank.hits += 1
        rank.priority = self._age_floor + rank.hits
        rank.last_tick = self._tick

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
        self._age_floor = 0.0

    def order(self) -> list[K]:
        """Every key, first victim first (a snapshot: the owner may evict while walking it)."""
        return sorted(self._ranks, key=lambda k: (self._ranks[k].priority, -self._ranks[k].depth,
                                                  self._ranks[k].last_tick))

    def evict_while(self, over_budget: Callable[[], bool], evict: Callable[[K], bool]) -> list[K]:
        """Offer keys to `evict` in order while `over_budget()`; `evict(key)` drops the owner's entry and returns
        True, or returns False to keep it (pinned, protected). Returns the keys evicted (the floor rose for each)."""
        done: list[K] = []
        if not over_budget():
            return done
        for key in self.order():
            if not over_budget():
                break
            rank = self._ranks.get(key)
            if rank is not None and evict(key):  # evict may already have called remove(key): rank is kept here
                self._ranks.pop(key, None)
                self._age_floor = max(self._age_floor, rank.priority)
                done.append(key)
        return done
