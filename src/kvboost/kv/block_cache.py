"""Stored chunks as pool blocks: the prefix cache that the block pool evicts from.

A stored chunk is the block ids holding its tokens (one block when block size = chunk size) plus one hold on each
(the cache's). An exact hit hands those ids to a sequence's block table, which takes its own hold: nothing is
copied. Write-back of a sequence's chunk keeps the blocks it already wrote: nothing is cloned.

Eviction follows the memory tier's policy (store/policy.py, LFU with dynamic aging) under a byte budget over the
blocks the cache holds, and also runs when the pool runs out of free blocks (the pool's evictor). A chunk is
pinned while any of its blocks has a holder besides the cache (a running sequence reads it): eviction skips it,
and since the pool frees a block only when its last hold goes, a block a sequence reads is never freed anyway.
"""
from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..store.policy import LfuAging
from .blocks import BlockError, BlockPool


@dataclass(frozen=True)
class CachedChunk:
    key: str
    blocks: tuple[int, ...]
    token_ids: tuple[int, ...]  # compared with the prompt's before a hit is trusted (a key collision is not a hit)
    start: int  # first position: the policy evicts chain tails (deeper chunks) first among equals
    parent_key: str | None = None  # the chunk before it in the prefix chain: partial matches search its children

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class BlockCacheStats:
    entries: int = 0
    blocks: int = 0
    bytes: int = 0
    budget_bytes: int | None = None
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    pinned_skips: int = 0  # times eviction passed over a chunk a running sequence reads


class BlockCache:
    """chunk key -> blocks, under a byte budget (None: the pool's size is the only bound). Thread-safe."""

    def __init__(self, pool: BlockPool, budget_bytes: int | None = None, evict_on_demand: bool = True,
                 spill: Callable[[CachedChunk], object] | None = None):
        """spill(chunk): called with each evicted chunk while its blocks are still held (host offload copies them
        out); a delete is not an eviction and is not spilled."""
        self.pool = pool
        self.spill = spill
        self.budget_bytes = budget_bytes
        self._chunks: dict[str, CachedChunk] = {}
        self._held: Counter[int] = Counter()  # holds the cache itself has on each block
        self._children: dict[str | None, set[str]] = {}
        self._policy: LfuAging[str] = LfuAging()
        self._lock = threading.RLock()
        self._stats = BlockCacheStats(budget_bytes=budget_bytes)
        if evict_on_demand:
            pool.set_evictor(self.evict_blocks)

    # ---- reads -----------------------------------------------------------------------------------
    def get(self, key: str) -> CachedChunk | None:
        """The chunk's blocks (counted as a hit for eviction); the caller maps them into a table (its own hold)
        before anything else can evict them: see BlockTable.map_shared."""
        with self._lock:
            chunk = self._chunks.get(key)
            if chunk is None:
                self._stats.misses += 1
                return None
            self._policy.touch(key)
            self._stats.hits += 1
            return chunk

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._chunks

    def acquire(self, key: str, n_tokens: int | None = None) -> CachedChunk | None:
        """get(), and one hold on each block covering the chunk's first n_tokens (default all), taken under the
        cache's lock: no eviction can free them between the lookup and the caller's use. The caller owns those
        holds (BlockTable.map_shared(..., held=True) adopts them)."""
        with self._lock:
            chunk = self.get(key)
            if chunk is not None:
                n = chunk.n_tokens if n_tokens is None else n_tokens
                if not 0 < n <= chunk.n_tokens:
                    raise BlockError(f"cannot acquire {n} tokens of a {chunk.n_tokens}-token chunk")
                self.pool.incref(chunk.blocks[:self.pool.layout.blocks_for(n)])
            return chunk

    def children(self, parent_key: str | None) -> list[CachedChunk]:
        """Stored chunks whose parent is `parent_key` (not counted as hits)."""
        with self._lock:
            return [self._chunks[k] for k in self._children.get(parent_key, ())]

    def pinned(self, key: str) -> bool:
        """Whether a holder besides the cache (a running sequence) holds any of the chunk's blocks."""
        with self._lock:
            chunk = self._chunks.get(key)
            return chunk is not None and self._pinned(chunk)

    # ---- writes ----------------------------------------------------------------------------------
    def put(self, key: str, blocks: Sequence[int], token_ids: Sequence[int], start: int,
            parent_key: str | None = None, enforce_budget: bool = True) -> bool:
        """Keep `blocks` (held by the caller, e.g. the sequence that wrote them) as chunk `key` holding
        `token_ids` at positions start...: the cache takes its own hold, nothing is copied; other chunks are evicted
        while over budget. Returns whether the chunk is stored.

        enforce_budget=False leaves the budget to the caller's trim() after a run of puts: each put of a long
        prompt's chunks would otherwise walk past the run's earlier chunks, pinned by the caller's table (cheapest
        first: new and deep), which is quadratic (235 chunks: 65 ms of bookkeeping)."""
        blocks, token_ids = tuple(blocks), tuple(token_ids)
        n_tokens = len(token_ids)
        bs = self.pool.layout.block_size
        if not blocks or not (len(blocks) - 1) * bs < n_tokens <= len(blocks) * bs:
            raise BlockError(f"{len(blocks)} blocks cannot hold exactly {n_tokens} tokens of {bs} per block")
        with self._lock:
            if key in self._chunks:
                self._policy.touch(key)
                return True
            self.pool.incref(blocks)  # raises FreeBlockError for blocks nobody holds: the cache never revives one
            self._chunks[key] = CachedChunk(key, blocks, token_ids, start, parent_key)
            self._children.setdefault(parent_key, set()).add(key)
            self._held.update(blocks)
            self._policy.add(key, depth=start)
            if enforce_budget:
                self._policy.evict_while(self._over_budget, lambda k: k != key and self._drop_if_unpinned(k))
            return key in self._chunks

    def delete(self, key: str) -> bool:
        """Forget a chunk (not an eviction); its blocks stay alive while sequences hold them. False if absent."""
        with self._lock:
            chunk = self._chunks.pop(key, None)
            if chunk is None:
                return False
            self._policy.remove(key)
            self._release(chunk)
            return True

    def clear(self) -> None:
        with self._lock:
            for key in list(self._chunks):
                self.delete(key)
            self._policy.reset()

    def trim(self) -> int:
        """Evict unpinned chunks, coldest first, while over budget: chunks stored while a sequence still held them
        (pinned, so put() had to keep them) go once it has let go. Returns how many chunks were evicted."""
        with self._lock:
            return len(self._policy.evict_while(self._over_budget, self._drop_if_unpinned))

    def evict_blocks(self, n: int) -> int:
        """The pool's evictor: evict unpinned chunks, coldest first, until n blocks are free again (or nothing
        unpinned is left). Returns the number of blocks freed."""
        freed = 0

        def want_more() -> bool:
            return freed < n

        def evict(key: str) -> bool:
            nonlocal freed
            chunk = self._chunks[key]
            if self._pinned(chunk):
                self._stats.pinned_skips += 1
                return False
            freed += self._drop(key)
            return True

        with self._lock:
            self._policy.evict_while(want_more, evict)
        return freed

    # ---- accounting ------------------------------------------------------------------------------
    def stats(self) -> BlockCacheStats:
        with self._lock:
            s = self._stats
            s.entries, s.blocks = len(self._chunks), len(self._held)
            s.bytes = len(self._held) * self.pool.layout.block_nbytes
            return BlockCacheStats(**vars(s))

    @property
    def bytes_used(self) -> int:
        with self._lock:
            return len(self._held) * self.pool.layout.block_nbytes

    # ---- internals -------------------------------------------------------------------------------
    def _over_budget(self) -> bool:
        return self.budget_bytes is not None and len(self._held) * self.pool.layout.block_nbytes > self.budget_bytes

    def _pinned(self, chunk: CachedChunk) -> bool:
        blocks = set(chunk.blocks)
        return any(n > self._held[b] for b, n in zip(blocks, self.pool.refcounts(blocks)))

    def _drop_if_unpinned(self, key: str) -> bool:
        if self._pinned(self._chunks[key]):
            self._stats.pinned_skips += 1
            return False
        self._drop(key)
        return True

    def _drop(self, key: str) -> int:
        """Evict: the cache's holds go; returns how many blocks became free."""
        chunk = self._chunks.pop(key)
        self._stats.evictions += 1
        if self.spill is not None:
            self.spill(chunk)
        return self._release(chunk)

    def _release(self, chunk: CachedChunk) -> int:
        siblings = self._children.get(chunk.parent_key)
        if siblings is not None:
            siblings.discard(chunk.key)
            if not siblings:
                del self._children[chunk.parent_key]
        self._held.subtract(chunk.blocks)
        for b in set(chunk.blocks):
            if self._held[b] <= 0:
                del self._held[b]
        return len(self.pool.decref(chunk.blocks))
