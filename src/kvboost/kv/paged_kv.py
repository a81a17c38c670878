"""The KV-cache manager's block path: an exact hit maps stored blocks into a sequence's block table (no copy);
write-back keeps the sequence's blocks as stored chunks (no clone).

    lookup(ids, salt) -> PagedPlan        the prompt's longest stored prefix, mapped into a new BlockTable
    place(plan, workspace, resident)      CPU mirror: copy the mapped positions into the contiguous workspace
    ... the caller runs its forwards over the workspace (or, with the paged kernel, over the table) ...
    absorb(table, workspace, end)         CPU mirror: the workspace's new positions into the table's own blocks
    write_back(table, ids, salt)          every chunk of ids the table holds becomes a stored chunk (its blocks)
    table.release()                       the sequence's holds go; stored chunks keep theirs

Cuts must be fixed (no boundary window) and the chunk size a multiple of the block size, so that every chunk
starts on a block boundary and a stored chunk is whole blocks (its last one partly filled for a remainder).

The "mirror" is today's contiguous workspace, kept while the model's own attention (CPU) needs contiguous K/V:
placing still copies (one gather per layer) and absorbing copies the new positions once. The paged kernel
(model/attention/paged.py) reads the table directly and needs neither.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from ..chunking import Chunk, Chunker
from ..reuse.match import common_prefix_length
from .block_cache import BlockCache
from .block_table import BlockTable
from .blocks import BlockError, BlockLayoutError, BlockPool
from .workspace import KVWorkspace


@dataclass
class PagedPlan:
    """positions [0, reuse_len) of the prompt are mapped from `chunks` stored chunks into `table`."""

    table: BlockTable
    n_prompt: int
    reuse_len: int = 0
    chunks: int = 0
    lookup_ms: float = 0.0


class PagedKV:
    def __init__(self, chunker: Chunker, pool: BlockPool, cache: BlockCache):
        if chunker.boundary_window:
            raise BlockLayoutError("paged KV needs fixed chunk cuts (chunk_boundary_window=0): a chunk must start "
                                   "on a block boundary")
        if chunker.chunk_size % pool.layout.block_size:
            raise BlockLayoutError(f"block size {pool.layout.block_size} does not divide the chunk size "
                                   f"{chunker.chunk_size}")
        if cache.pool is not pool:
            raise BlockLayoutError("the block cache must keep blocks of this pool")
        self.chunker, self.pool, self.cache = chunker, pool, cache

    # ---- lookup ---------------------------------------------------------------------------------------
    def lookup(self, ids: Sequence[int], salt: str | None) -> PagedPlan:
        """Map the longest stored prefix of `ids` (whole chunks by key, then the best stored sibling at token
        granularity) into a new table; at most len(ids) - 1 positions: the last prompt token always runs."""
        t0 = time.perf_counter()
        ids = list(ids)
        plan = PagedPlan(BlockTable(self.pool), len(ids))
        for chunk in self.chunker.split(ids, salt):
            if chunk.complete and self._map_whole(plan, chunk):
                continue
            self._map_partial(plan, chunk, ids)
            break
        limit = max(len(ids) - 1, 0)
        if plan.table.length > limit:
            plan.table.truncate(limit)
        plan.reuse_len = plan.table.length
        plan.lookup_ms = (time.perf_counter() - t0) * 1e3
        return plan

    def _map_whole(self, plan: PagedPlan, chunk: Chunk) -> bool:
        hit = self.cache.acquire(chunk.prefix_key)
        if hit is None:
            return False
        if hit.token_ids != chunk.token_ids or hit.start != chunk.start:  # a key collision is not a hit
            self.pool.decref(hit.blocks)
            return False
        plan.table.map_shared(hit.blocks, hit.n_tokens, held=True)
        plan.chunks += 1
        return True

    def _map_partial(self, plan: PagedPlan, chunk: Chunk, ids: list[int]) -> None:
        """The stored sibling of `chunk` (same parent, same start) agreeing longest with the prompt from there."""
        best, agree = None, 0
        for sibling in self.cache.children(chunk.parent_key):
            if sibling.start != chunk.start:
                continue
            n = common_prefix_length(sibling.token_ids, ids[chunk.start:])
            if n > agree:
                best, agree = sibling, n
        if best is None:
            return
        hit = self.cache.acquire(best.key, agree)  # None if evicted since children() looked
        if hit is None:
            return
        plan.table.map_shared(hit.blocks[:self.pool.layout.blocks_for(agree)], agree, held=True)
        plan.chunks += 1

    # ---- the contiguous mirror (CPU) --------------------------------------------------------------------
    def place(self, plan: PagedPlan, workspace: KVWorkspace, resident: int = 0) -> None:
        """Copy positions [resident, reuse_len) of the plan's table into batch row 0.. of `workspace` (every row):
        one gather per layer."""
        lo, hi = resident, plan.reuse_len
        if hi <= lo:
            return
        bs = self.pool.layout.block_size
        first, last = lo // bs, self.pool.layout.blocks_for(hi)
        ids = plan.table.ids()[first:last][None].to(self.pool.device)  # [1, blocks]
        cut = lo - first * bs
        for layer in range(self.pool.layout.layers):
            k, v = self.pool.gather(layer, ids)  # [1, H, blocks * bs, d]
            workspace.write_layer(layer, [k[0, :, cut:cut + hi - lo]], [v[0, :, cut:cut + hi - lo]], lo)

    def absorb(self, table: BlockTable, workspace: KVWorkspace, end: int, row: int = 0) -> None:
        """Positions [table.length, end) of workspace row `row` into the table's own blocks (reserved here)."""
        start = table.length
        if end <= start:
            return
        table.reserve(end - start)
        for layer in range(self.pool.layout.layers):
            k_buf, v_buf = workspace.buffers(layer)
            c0, c1 = start - workspace.base, end - workspace.base
            table.write(layer, start, k_buf[row, :, c0:c1], v_buf[row, :, c0:c1])

    # ---- write-back -------------------------------------------------------------------------------------
    def write_back(self, table: BlockTable, ids: Sequence[int], salt: str | None) -> tuple[int, int]:
        """Store every chunk of ids[:table.length] not stored yet as the table's blocks; returns (new, existing).
        A stored partial sibling that a new complete chunk extends is dropped (dead weight)."""
        n = min(table.length, len(ids))
        bs = self.pool.layout.block_size
        new = existing = 0
        for chunk in self.chunker.split(list(ids[:n]), salt):
            if self.cache.contains(chunk.prefix_key):
                existing += 1
                continue
            if chunk.start % bs:
                raise BlockError(f"chunk at {chunk.start} does not start on a block boundary")
            blocks = table.blocks[chunk.start // bs:self.pool.layout.blocks_for(chunk.end)]
            if self.cache.put(chunk.prefix_key, blocks, chunk.token_ids, chunk.start, chunk.parent_key):
                new += 1
            if chunk.complete:
                for sibling in self.cache.children(chunk.parent_key):
                    m = sibling.n_tokens
                    if m < chunk.end - chunk.start and sibling.token_ids == chunk.token_ids[:m]:
                        self.cache.delete(sibling.key)
        return new, existing
