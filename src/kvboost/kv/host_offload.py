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
"""
from __future__ import annotations

import threading
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
    offloaded: int = 0  # chunks moved device -> host
    restored: int = 0  # chunks moved host -> device on a hit
    evictions: int = 0  # chunks dropped from the host pool (its budget)
    failures: dict[str, int] = field(default_factory=dict)  # reason -> count; each is a recompute, never an error


class HostOffload:
    """The host tier of a device block pool. Thread-safe; never raises from stash / restore."""

    def __init__(self, device: BlockPool, host: BlockPool):
        if device.layout != host.layout:
            raise BlockLayoutError(f"host pool layout {host.layout} differs from the device pool's {device.layout}")
        self.device, self.host = device, host
        self._chunks: dict[str, CachedChunk] = {}  # key -> the chunk, its blocks being host-pool ids
        self._children: dict[str | None, set[str]] = {}  # parent key -> host chunk keys (token-granular matches)
        self._policy: LfuAging[str] = LfuAging()
        self._lock = threading.RLock()
        self._stats = OffloadStats(budget_bytes=host.nbytes, pinned=host.storage.is_pinned())

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
        """n host blocks, evicting the coldest host chunks while too few are free (host blocks have no other
        holder, so everything but the pool's size is evictable)."""
        if n > self.host.num_blocks:
            raise OutOfBlocksError(f"a {n}-block chunk is larger than the host pool ({self.host.num_blocks})")

        def short() -> bool:
            return self.host.num_free < n

        def evict(key: str) -> bool:
            self._drop(key)
            self._stats.evictions += 1
            return True

        self._policy.evict_while(short, evict)
        return self.host.allocate(n, zero=False)  # every position is copied over (see BlockPool.allocate)

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
            s.blocks = sum(len(c.blocks) for c in self._chunks.values())
            s.bytes = s.blocks * self.host.layout.block_nbytes
            return OffloadStats(**{**vars(s), "failures": dict(s.failures)})

    def _add(self, chunk: CachedChunk) -> None:
        self._chunks[chunk.key] = chunk
        self._children.setdefault(chunk.parent_key, set()).add(chunk.key)
        self._policy.add(chunk.key, depth=chunk.start)

    def _forget(self, key: str) -> CachedChunk:
        """Take the chunk out of the maps (its blocks are the caller's to release); the policy is the caller's."""
        chunk = self._chunks.pop(key)
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


def host_pool_for(device: BlockPool, budget_bytes: int) -> BlockPool | None:
    """A host pool with the device pool's layout for `budget_bytes` (None when that is not one block): pinned
    memory when the device is CUDA (pageable if pinning fails)."""
    n = budget_bytes // device.layout.block_nbytes
    if n <= 0:
        return None
    if device.device.type == "cuda":
        try:
            return BlockPool(device.layout, n, "cpu", pin_memory=True)
        except RuntimeError:  # pinned memory is scarcer than pageable: offload still works, copies just block
            pass
    return BlockPool(device.layout, n, "cpu")
