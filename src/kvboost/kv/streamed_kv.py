"""Sequences longer than the device may hold: their K/V lives in host blocks, the host offload's pool.

    streams(n)                     whether a sequence of n positions runs streamed (n > max_device_tokens)
    lookup(ids, salt) -> PagedPlan the longest stored prefix in a table over the host pool: host chunks mapped (no
                                   copy, held), device chunks copied block by block, disk / Redis records loaded
    ... model/streamed_sequence.py runs the forwards, one layer's K/V on the device at a time ...
    write_back(table, ids, salt)   the new chunks stay in the table's host blocks as host chunks (no copy), and are
                                   written behind to disk / Redis

A later request (streamed or not) finds those chunks: a streamed one maps them, a resident one restores them to the
device (kv/host_offload.py). The host pool has room for one streamed sequence beyond the stored chunks' budget
(requests run one at a time under the engine lock).
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..chunking import Chunk
from ..reuse.match import common_prefix_length
from ..store.base import ChunkRecord
from .block_cache import CachedChunk
from .block_table import BlockTable
from .blocks import BlockError, BlockLayout, BlockLayoutError, BlockPool
from .host_offload import HostOffload
from .layer_stream import Resident
from .paged_kv import PagedKV, PagedPlan, load_record
from .workspace import LayerShape


@dataclass
class StreamedStats:
    max_device_tokens: int
    requests: int = 0
    mapped_chunks: int = 0  # host chunks mapped without a copy
    copied_chunks: int = 0  # device chunks copied into host blocks
    loaded_chunks: int = 0  # records from disk / Redis loaded into host blocks
    adopted_chunks: int = 0  # chunks written back as host chunks
    load_failures: int = 0
    resident_failures: int = 0  # no device blocks for a sequence's first positions: all of it crossed each step
    forwards: int = 0
    bytes_to_device: int = 0  # K/V of earlier positions brought to the device, every layer of every forward
    bytes_to_host: int = 0  # the forwards' own K/V written to host blocks


class StreamedKV:
    def __init__(self, paged: PagedKV, max_device_tokens: int):
        if paged.host is None:
            raise BlockLayoutError("streaming a sequence from host memory needs host offload (device_kv_budget_bytes)")
        self.paged = paged
        self.host: HostOffload = paged.host
        self.pool: BlockPool = paged.host.host
        self.stats = StreamedStats(max_device_tokens)

    @property
    def max_device_tokens(self) -> int:
        return self.stats.max_device_tokens

    @property
    def host_copy(self) -> str:
        """How host blocks reach the device each forward (kv/host_copy.py on CUDA)."""
        if self.paged.pool.device.type != "cuda":
            return "one concatenation per layer (the device reads host memory)"
        from .host_copy import row_copier

        return row_copier().status

    def streams(self, n_positions: int) -> bool:
        return n_positions > self.stats.max_device_tokens

    def count(self, forwards: int, bytes_to_device: int, bytes_to_host: int) -> None:
        """A finished streamed request's transfers (model/streamed_sequence.py counts them)."""
        self.stats.requests += 1
        self.stats.forwards += forwards
        self.stats.bytes_to_device += bytes_to_device
        self.stats.bytes_to_host += bytes_to_host

    def new_table(self) -> BlockTable:
        """An empty table over host blocks for a new streamed sequence."""
        if self.paged.pool.device.type == "cuda":
            # Until now host blocks were only read and written by copies queued on the device's stream (offload's
            # stash / restore); a streamed sequence's host-side writes (copy on write, zero fills, records loaded,
            # its K/V) must not overtake those still queued: settle them once per request.
            torch.cuda.current_stream(self.paged.pool.device).synchronize()
        return BlockTable(self.pool)

    def resident(self, n_positions: int) -> Resident | None:
        """Device blocks for the first min(max_device_tokens, n_positions) positions of a streamed sequence
        (kept there, read there each forward); None, counted, when the device pool has no room for them."""
        table = BlockTable(self.paged.pool)
        try:
            table.reserve(min(self.max_device_tokens, n_positions))
        except BlockError:
            self.stats.resident_failures += 1
            return None
        return Resident(table)

    # ---- lookup ---------------------------------------------------------------------------------------
    def lookup(self, ids: Sequence[int], salt: str | None, token_granular: bool = True) -> PagedPlan:
        """Map the longest stored prefix of ids (at most len(ids) - 1 positions) into a new host table."""
        t0 = time.perf_counter()
        ids = list(ids)
        plan = PagedPlan(self.new_table(), len(ids))
        for chunk in self.paged.chunker.split(ids, salt):
            if chunk.complete and self._map_whole(plan, chunk):
                continue
            if token_granular:
                self._map_partial(plan, chunk, ids)
            break
        if plan.table.length > max(len(ids) - 1, 0):
            plan.table.truncate(max(len(ids) - 1, 0))
        plan.reuse_len = plan.table.length
        plan.lookup_ms = (time.perf_counter() - t0) * 1e3
        return plan

    def _map_whole(self, plan: PagedPlan, chunk: Chunk) -> bool:
        hit = self.host.acquire(chunk.prefix_key)
        if hit is not None:
            if hit.token_ids != chunk.token_ids or hit.start != chunk.start:  # a key collision is not a hit
                self.pool.decref(hit.blocks)
                return False
            plan.table.map_shared(hit.blocks, hit.n_tokens, held=True)
            self.stats.mapped_chunks += 1
        elif not self._copy_from_device(plan.table, chunk.prefix_key, chunk, chunk.end - chunk.start) \
                and not self._load(plan.table, chunk):
            return False
        plan.chunks += 1
        return True

    def _copy_from_device(self, table: BlockTable, key: str, chunk: Chunk | CachedChunk, n: int) -> bool:
        """The first n tokens of a device chunk copied into new blocks of the table (one copy per block)."""
        hit = self.paged.cache.acquire(key, n) if self.paged.cache.contains(key) else None
        if hit is None:
            return False
        try:
            if hit.token_ids[:n] != tuple(chunk.token_ids[:n]) or hit.start != chunk.start:
                return False
            start = table.length
            table.reserve(n)
            bs = self.pool.layout.block_size
            for j, block in enumerate(hit.blocks[:self.pool.layout.blocks_for(n)]):
                self.pool.copy_from(self.paged.pool, block, table.blocks[start // bs + j])
            if self.paged.pool.device.type == "cuda":
                # Device -> pinned host copies are asynchronous, and the host blocks may next be read on the CPU
                # (write-back's snapshot for disk / Redis, with no forward in between: a warm that reused it all).
                torch.cuda.current_stream(self.paged.pool.device).synchronize()
        finally:
            self.paged.pool.decref(hit.blocks[:self.pool.layout.blocks_for(n)])
        self.stats.copied_chunks += 1
        return True

    def _load(self, table: BlockTable, chunk: Chunk) -> bool:
        """A whole chunk from disk / Redis into new host blocks of the table, then kept as a host chunk."""
        slow = self.paged.slow
        record = None if slow is None else slow.get(chunk.prefix_key)
        if record is None or record.token_ids != chunk.token_ids or record.start != chunk.start:
            return False
        if not self._load_record(table, record):
            return False
        self._adopt(table, chunk)
        return True

    def _load_record(self, table: BlockTable, record: ChunkRecord) -> bool:
        """A record's tokens appended to the table in new host blocks; False (counted, the table as it was) when
        there is no room or the record has another shape."""
        start = table.length
        try:
            load_record(table, record)
        except (BlockError, RuntimeError, ValueError, IndexError):
            table.truncate(start)
            self.stats.load_failures += 1
            return False
        self.stats.loaded_chunks += 1
        return True

    def _map_partial(self, plan: PagedPlan, chunk: Chunk, ids: list[int]) -> None:
        """The stored sibling agreeing longest with the prompt from chunk.start: host (mapped), device (copied), or
        - after a restart, or from another process sharing them - disk / Redis (loaded into the table)."""
        best, agree = None, 0
        siblings = self.host.children(chunk.parent_key) + self.paged.cache.children(chunk.parent_key)
        if self.paged.slow is not None:  # listed last: an equal match is taken from memory
            siblings += self.paged.slow.children(chunk.parent_key)
        for sibling in siblings:
            n = common_prefix_length(sibling.token_ids, ids[chunk.start:]) if sibling.start == chunk.start else 0
            if n > agree:
                best, agree = sibling, n
        if best is None:
            return
        hit = self.host.acquire(best.key, agree) if self.host.contains(best.key) else None
        if hit is not None:
            plan.table.map_shared(hit.blocks[:self.pool.layout.blocks_for(agree)], agree, held=True)
            self.stats.mapped_chunks += 1
        elif not self._copy_from_device(plan.table, best.key, best, agree) \
                and not self._load_partial(plan.table, best.key, ids[chunk.start:], agree):
            return
        plan.chunks += 1

    def _load_partial(self, table: BlockTable, key: str, ids: Sequence[int], agree: int) -> bool:
        """The first `agree` tokens of a disk / Redis record into new host blocks of the table (the sequence's
        own: write-back stores its chunks as usual)."""
        record = None if self.paged.slow is None else self.paged.slow.get(key)
        if record is None or common_prefix_length(record.token_ids, ids) < agree:
            return False
        start = table.length
        if not self._load_record(table, record):
            return False
        table.truncate(start + agree)
        return True

    # ---- write-back -----------------------------------------------------------------------------------
    def write_back(self, table: BlockTable, ids: Sequence[int], salt: str | None) -> tuple[int, int]:
        """Every chunk of ids the table holds that is stored nowhere yet becomes a host chunk over the table's
        blocks (no copy) and is written behind to the slow tiers; returns (new, existing)."""
        n = min(table.length, len(ids))
        new = existing = 0
        for chunk in self.paged.chunker.split(list(ids[:n]), salt):
            if self.paged.cache.contains(chunk.prefix_key) or self.host.contains(chunk.prefix_key):
                existing += 1
                continue
            if self._adopt(table, chunk):
                new += 1
            if chunk.complete:  # a stored partial sibling this chunk extends is dead weight
                for sibling in self.host.children(chunk.parent_key):
                    m = sibling.n_tokens
                    if m < chunk.end - chunk.start and sibling.token_ids == chunk.token_ids[:m]:
                        self.host.discard(sibling.key)
        return new, existing

    def _adopt(self, table: BlockTable, chunk: Chunk) -> bool:
        bs = self.pool.layout.block_size
        if chunk.start % bs:
            raise BlockError(f"chunk at {chunk.start} does not start on a block boundary")
        blocks = table.blocks[chunk.start // bs:self.pool.layout.blocks_for(chunk.end)]
        kept = self.host.adopt(chunk.prefix_key, blocks, chunk.token_ids, chunk.start, chunk.parent_key)
        slow = self.paged.slow
        if kept and slow is not None and not slow.contains(chunk.prefix_key):
            slow.put(self.paged.snapshot(chunk, blocks, self.pool))
        self.stats.adopted_chunks += int(kept)
        return kept


RUNNING_SHARE = 0.6  # of the device memory free at load: stored chunks plus two sequences' blocks, at most
STREAMED_SHARE = 0.15  # ... else the device part of one sequence, when the longest ones would not fit


def device_max_tokens(configured: int | None, device: torch.device, device_budget_bytes: int | None,
                      shapes: Sequence[LayerShape], dtype: torch.dtype, max_context: int | None) -> int | None:
    """The most positions of one sequence whose K/V the device holds (None: no limit; a longer context is
    streamed from host memory). As configured; elsewhere than CUDA none (the device is host memory); on CUDA none
    while the stored chunks' budget and two sequences of the model's longest context fit in 60% of the device
    memory free now (the pool holds them: build_paged_kv), else what 15% of it holds."""
    if configured is not None:
        return configured
    if device.type != "cuda" or device_budget_bytes is None:
        return None
    per_token = BlockLayout.for_layers(shapes, 1, dtype).block_nbytes
    free, _ = torch.cuda.mem_get_info(device)
    if device_budget_bytes + 2 * (max_context or 32768) * per_token <= RUNNING_SHARE * free:
        return None
    return max(1, int(STREAMED_SHARE * free) // per_token)
