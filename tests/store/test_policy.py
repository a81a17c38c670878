"""LfuAging: the heap with lazy deletion evicts in exactly the order of the sorted definition (priority, then
deeper, then staler), skips kept keys without losing them, and costs O(log n) per offer."""
from __future__ import annotations

import copy
import random

from kvboost.store.memory import LfuAging


class SortedReference:
    """The definition, sorted on every eviction (the implementation before the heap)."""

    def __init__(self) -> None:
        self.ranks: dict[str, list] = {}  # key -> [priority, depth, hits, tick]
        self.floor, self.tick = 0.0, 0

    def add(self, key: str, depth: int) -> None:
        if key in self.ranks:
            self.touch(key)
            return
        self.tick += 1
        self.ranks[key] = [self.floor, depth, 0, self.tick]

    def touch(self, key: str) -> None:
        if key in self.ranks:
            self.tick += 1
            r = self.ranks[key]
            r[2] += 1
            r[0], r[3] = self.floor + r[2], self.tick

    def remove(self, key: str) -> None:
        self.ranks.pop(key, None)

    def evict_while(self, over, evict) -> list[str]:
        done = []
        for key in sorted(self.ranks, key=lambda k: (self.ranks[k][0], -self.ranks[k][1], self.ranks[k][3])):
            if not over():
                break
            if evict(key):
                self.floor = max(self.floor, self.ranks.pop(key)[0])
                done.append(key)
        return done


def _evict(policy, live: set[str], budget: int, pinned: set[str]) -> list[str]:
    """Evict while more than `budget` keys are live, keeping the pinned ones."""
    def evict(key: str) -> bool:
        if key in pinned:
            return False
        live.discard(key)
        return True

    return policy.evict_while(lambda: len(live) > budget, evict)


def _order(policy) -> list[str]:
    """Every key, first victim first (evicting all from a copy)."""
    return copy.deepcopy(policy).evict_while(lambda: True, lambda key: True)


def test_heap_evicts_in_the_sorted_order_on_random_traces():
    for seed in range(40):
        rng = random.Random(seed)
        heap, ref = LfuAging(), SortedReference()
        for _ in range(400):
            op = rng.random()
            key = f"k{rng.randrange(60)}"
            if op < 0.45:
                depth = rng.randrange(8) * 16
                heap.add(key, depth)
                ref.add(key, depth)
            elif op < 0.75:
                heap.touch(key)
                ref.touch(key)
            elif op < 0.85:
                heap.remove(key)
                ref.remove(key)
            else:
                pinned = {f"k{rng.randrange(60)}" for _ in range(rng.randrange(6))}
                budget = rng.randrange(len(ref.ranks) + 1)
                heap_got, ref_got = (_evict(policy, set(ref.ranks), budget, pinned) for policy in (heap, ref))
                assert heap_got == ref_got, seed
            assert _order(heap) == _order(ref) and len(heap) == len(ref.ranks)


def test_kept_keys_are_offered_again_and_each_once_per_call():
    policy = LfuAging()
    for i, key in enumerate("abcd"):
        policy.add(key, depth=i)
    offered: list[str] = []

    def keep_all(key: str) -> bool:
        offered.append(key)
        return False

    assert policy.evict_while(lambda: True, keep_all) == [] and offered == ["d", "c", "b", "a"]
    assert policy.evict_while(lambda: True, lambda k: k == "c") == ["c"]  # d is kept, offered first again
    assert _order(policy) == ["d", "b", "a"]


def test_many_touches_keep_the_heap_bounded_and_the_order_right():
    policy = LfuAging()
    for i in range(10):
        policy.add(f"k{i}", depth=0)
    for _ in range(50):
        for i in range(9):  # k9 never touched: the coldest
            policy.touch(f"k{i}")
    assert len(policy._heap) <= 2 * len(policy) + 64  # noqa: SLF001 - the compaction is what is tested
    assert policy.evict_while(lambda: len(policy) > 8, lambda k: True) == ["k9", "k0"]
