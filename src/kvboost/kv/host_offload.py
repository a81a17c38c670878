"""Host offload: stored chunks the device pool evicts move to a host block pool instead of being dropped, and come
back on a hit.

    device BlockCache evicts a cold, unpinned chunk  ->  stash(chunk): its blocks copied to host blocks (one copy
                                                         per block), kept under the host budget (LFU with aging)
    a lookup misses the device cache                 ->  restore(key): fresh device blocks, one copy per block back,
                                                         the host blocks freed; the caller caches the device blocks

The host pool has the device pool's layout (pinned memory on CUDA, so copies can run asynchronously). Every copy is
enqueued on the current stream: a device block freed after its copy out, or a host block reused after its copy
back, is only overwritten by work enqueued later on the same stream, so no synchronization is needed for
correctness (overlap on a side stream, layer by layer while earlier layers compute, is not built).

A stash or restore that fails - no host room, a failed copy (out of pinned memory), no free device block - is
counted by reason and costs nothing else: the chunk is recomputed (or read from disk / Redis) on its next use,
never served wrong.

Streamed sequences (kv/streamed_kv.py: a context longer than the device may hold) keep their K/V in host blocks of
this pool: they map host chunks without a copy (acquire) and leave their new chunks here (adopt). The host pool
then has room beyond the stored chunks' budget for one such sequence; a host chunk such a sequence reads is
pinned (never evicted from under it).
"""
from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..store.policy import LfuAging
from .block_cache import CachedChunk
from .blocks import BlockError, BlockLayoutError, BlockPool, OutOfBlocksError


@dataclass
class OffloadStats:
    entries: int = 0
    blocks: int = 0
    bytes: int = 0
    budget_bytes: int = 0
    pinned: bool = False
    unpinned_reason: str | None = None  # why a pool asked to be page-locked is pageable (its copies block)
    offloaded: int = 0  # chunks moved device -> host
    adopted: int = 0  # chunks a streamed sequence wrote, kept in its host blocks (no copy)
    restored: int = 0  # chunks moved host -> device on a hit
    evictions: int = 0  # chunks dropped from the host pool (its budget)
    failures: dict[str, int] = field(default_factory=dict)  # reason -> count; each is a recompute, never an error


class HostOffload:
    """The host tier of a device block pool. Thread-safe; never raises from stash / restore."""

    def __init__(self, device: BlockPool, host: BlockPool, budget_blocks: int | None = None):
        """budget_blocks: the most host blocks stored chunks keep (default the whole host pool; the rest is room
        for a streamed sequence's own blocks)."""
        if device.layout != host.layout:
            raise BlockLayoutError(f"host pool layout {host.layout} differs from the device pool's {device.layout}")
        self.device, self.host = device, host
        self.budget_blocks = host.num_blocks if budget_blocks is None else min(budget_blocks, host.num_blocks)
        self._chunks: dict[str, CachedChunk] = {}  # key -> the chunk, its blocks being host-pool ids
        self._held: Counter[int] = Counter()  # host block -> how many stored chunks hold it
        self._children: dict[str | None, set[str]] = {}  # parent key -> host chunk keys (token-granular matches)
        self._policy: LfuAging[str] = LfuAging()
        self._lock = threading.RLock()
        self._stats = OffloadStats(budget_bytes=self.budget_blocks * host.layout.block_nbytes,
                                   pinned=host.pinned, unpinned_reason=host.unpinned_reason)
        host.set_evictor(self._free_blocks)  # a streamed sequence's reservation may push cold chunks out

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._chunks

    def children(self, parent_key: str | None) -> list[CachedChunk]:
        """Host chunks whose parent is `parent_key` (their blocks are host ids: restore() before use)."""
        with self._lock:
            return [self._chunks[k] for k in self._children.get(parent_key, ())]

    # ---- device -> host -------------------------------------------------------------------------------
    def stash(self, chunk: CachedChunk) -> bool:
        """Copy an evicted device chunk's blocks to the host (its device blocks must still be held: the device
        cache calls this before releasing them). Returns whether the host keeps it."""
        with self._lock:
            if chunk.key in self._chunks:
                self._policy.touch(chunk.key)
                return True
            try:
                blocks = self._allocate(len(chunk.blocks))
            except BlockError:
                return self._failed("host_full")
            try:
                for host_block, device_block in zip(blocks, chunk.blocks):
                    self.host.copy_from(self.device, device_block, host_block)
            except RuntimeError:  # out of (pinned) memory, a device error: this chunk is recomputed later
                self.host.decref(blocks)
                return self._failed("copy_to_host")
            self._add(CachedChunk(chunk.key, tuple(blocks), chunk.token_ids, chunk.start, chunk.parent_key))
            self._stats.offloaded += 1
            return True

    def _allocate(self, n: int) -> list[int]:
        """n host blocks for a new stored chunk, evicting the coldest unpinned host chunks while the stored chunks
        would exceed the budget or too few blocks are free."""
        if n > self.budget_blocks:
            raise OutOfBlocksError(f"a {n}-block chunk is larger than the host budget ({self.budget_blocks} blocks)")
        self._make_room(lambda: len(self._held) + n > self.budget_blocks or self.host.num_free < n)
        return self.host.allocate(n, zero=False)  # every position is copied over (see BlockPool.allocate)

    def _make_room(self, short) -> None:
        def evict(key: str) -> bool:
            if self._pinned(self._chunks[key]):
                return False
            self._drop(key)
            self._stats.evictions += 1
            return True

        self._policy.evict_while(short, evict)

    def _free_blocks(self, n: int) -> int:
        """The host pool's evictor (a streamed sequence reserving blocks): unpinned chunks out until n are free."""
        with self._lock:
            before = self.host.num_free
            self._make_room(lambda: self.host.num_free < before + n)
            return self.host.num_free - before

    def _pinned(self, chunk: CachedChunk) -> bool:
        """Whether a holder besides the stored chunks (a streamed sequence's table) holds any of its blocks."""
        return any(self.host.refcount(b) > self._held[b] for b in set(chunk.blocks))

    # ---- host -> device -------------------------------------------------------------------------------
    def restore(self, key: str) -> tuple[CachedChunk, list[int]] | None:
        """The host chunk `key` copied into fresh device blocks: (its metadata, the device blocks, held once by
        the caller), and gone from the host. None when the host does not hold it or the move failed (counted)."""
        with self._lock:
            chunk = self._chunks.get(key)
            if chunk is None:
                return None
            self._forget(key)
            self._policy.remove(key)
        try:
            # Outside the host lock: making room may evict device chunks, which stash() here.
            blocks = self.device.allocate(len(chunk.blocks), zero=False)
        except BlockError:
            self._put_back(chunk)
            self._failed("device_full")
            return None
        try:
            for device_block, host_block in zip(blocks, chunk.blocks):
                self.device.copy_from(self.host, host_block, device_block)
        except RuntimeError:
            self.device.decref(blocks)
            self.host.decref(chunk.blocks)
            self._failed("copy_to_device")
            return None
        self.host.decref(chunk.blocks)  # later reuse of these host blocks is ordered after the copy (one stream)
        with self._lock:
            self._stats.restored += 1
        return chunk, blocks

    def _put_back(self, chunk: CachedChunk) -> None:
        with self._lock:
            if chunk.key in self._chunks:  # stashed again meanwhile: keep one copy
                self.host.decref(chunk.blocks)
                return
            self._add(chunk)

    # ---- streamed sequences (their K/V stays in host blocks) -------------------------------------------
    def acquire(self, key: str, n_tokens: int | None = None) -> CachedChunk | None:
        """A host chunk (counted as a use) with one hold on each host block covering its first n_tokens (default
        all), the caller's to drop (host.decref): the chunk is pinned while they are held."""
        with self._lock:
            chunk = self._chunks.get(key)
            if chunk is None:
                return None
            n = chunk.n_tokens if n_tokens is None else n_tokens
            if not 0 < n <= chunk.n_tokens:
                raise BlockError(f"cannot acquire {n} tokens of a {chunk.n_tokens}-token chunk")
            self._policy.touch(key)
            self.host.incref(chunk.blocks[:self.host.layout.blocks_for(n)])
            return chunk

    def adopt(self, key: str, blocks: Sequence[int], token_ids: Sequence[int], start: int,
              parent_key: str | None = None) -> bool:
        """Keep host blocks a streamed sequence wrote (held by its table) as chunk `key`: no copy, one more hold
        each. Colder unpinned chunks make room under the budget; False (counted as host_full) if they cannot."""
        chunk = CachedChunk(key, tuple(blocks), tuple(token_ids), start, parent_key)
        with self._lock:
            if key in self._chunks:
                self._policy.touch(key)
                return True
            fresh = len(set(chunk.blocks) - set(self._held))
            self._make_room(lambda: len(self._held) + fresh > self.budget_blocks)
            if len(self._held) + fresh > self.budget_blocks:
                return self._failed("host_full")
            self.host.incref(chunk.blocks)
            self._add(chunk)
            self._stats.adopted += 1
            return True

    # ---- housekeeping --------------------------------------------------------------------------------
    def discard(self, key: str) -> None:
        """Forget a host chunk (the device holds it again, or it was superseded)."""
        with self._lock:
            if key in self._chunks:
                self._policy.remove(key)
                self._drop(key)

    def clear(self) -> None:
        with self._lock:
            for key in list(self._chunks):
                self._drop(key)
            self._policy.reset()

    def stats(self) -> OffloadStats:
        with self._lock:
            s = self._stats
            s.entries = len(self._chunks)
            s.blocks = len(self._held)
            s.bytes = s.blocks * self.host.layout.block_nbytes
            return OffloadStats(**{**vars(s), "failures": dict(s.failures)})

    def _add(self, chunk: CachedChunk) -> None:
        self._chunks[chunk.key] = chunk
        self._held.update(chunk.blocks)
        self._children.setdefault(chunk.parent_key, set()).add(chunk.key)
        self._policy.add(chunk.key, depth=chunk.start)

    def _forget(self, key: str) -> CachedChunk:
        """Take the chunk out of the maps (its blocks are the caller's to release); the policy is the caller's."""
        chunk = self._chunks.pop(key)
        self._held.subtract(chunk.blocks)
        for b in set(chunk.blocks):
            if self._held[b] <= 0:
                del self._held[b]
        siblings = self._children.get(chunk.parent_key)
        if siblings is not None:
            siblings.discard(key)
            if not siblings:
                del self._children[chunk.parent_key]
        return chunk

    def _drop(self, key: str) -> None:
        self.host.decref(self._forget(key).blocks)

    def _failed(self, reason: str) -> bool:
        with self._lock:
            self._stats.failures[reason] = self._stats.failures.get(reason, 0) + 1
        return False


def host_pool_for(device: BlockPool, budget_bytes: int, extra_blocks: int = 0) -> BlockPool | None:
    """A host pool with the device pool's layout for `budget_bytes` of stored chunks and `extra_blocks` more (a
    streamed sequence's own), None when that is not one block: page-locked at its exact size when the device is
    CUDA (pageable where that fails: `unpinned_reason`)."""
    n = budget_bytes // device.layout.block_nbytes + extra_blocks
    if n <= 0:
        return None
    if device.device.type == "cuda":
        try:
            return BlockPool(device.layout, n, "cpu", pin_memory=True)
        except RuntimeError:  # pinned memory is scarcer than pageable: offload still works, copies just block
            pass
    return BlockPool(device.layout, n, "cpu")
