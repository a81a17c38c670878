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

Slower tiers (disk, Redis: `slow`, a TieredStore whose memory tier holds nothing - the blocks are the memory
tier): a chunk written back as blocks is also written behind to them (a copy of its K/V, since the blocks may be
evicted and reused before the writer gets to it); a whole chunk the block cache misses is looked up there and
loaded into fresh blocks (one copy per block for a packed record, format 2; per layer one slice copy per block
for a per-layer one), then cached like any other. Token-granular siblings are found in the block cache only.

The "mirror" is today's contiguous workspace, kept while the model's own attention (CPU) needs contiguous K/V:
placing still copies (per layer, the blocks' slices concatenated into the workspace) and absorbing copies the new
positions once. The paged kernel
(model/attention/paged.py) reads the table directly and needs neither.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Protocol

import torch

from ..chunking import Chunk, Chunker
from ..reuse.match import Segment, common_prefix_length
from ..store.base import ChunkMeta, ChunkRecord, ChunkStore
from .block_cache import BlockCache, CachedChunk
from .block_table import BlockTable
from .blocks import BlockError, BlockLayout, BlockLayoutError, BlockPool
from .host_offload import HostOffload, host_pool_for
from .workspace import KVWorkspace, LayerShape


class KVReadable(Protocol):
    """A sequence's K/V readable by position (a workspace, a batch row's prefixed view): owned copies."""

    def read(self, start: int, end: int, row: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]: ...


@dataclass
class PagedPlan:
    """positions [0, reuse_len) of the prompt are mapped from `chunks` stored chunks into `table`."""

    table: BlockTable
    n_prompt: int
    reuse_len: int = 0
    chunks: int = 0
    lookup_ms: float = 0.0
    mapped: list[tuple[CachedChunk, int]] = field(default_factory=list)  # (stored chunk, tokens of it mapped)


class PagedKV:
    def __init__(self, chunker: Chunker, pool: BlockPool, cache: BlockCache, slow: ChunkStore | None = None,
                 host: HostOffload | None = None):
        if chunker.boundary_window:
            raise BlockLayoutError("paged KV needs fixed chunk cuts (chunk_boundary_window=0): a chunk must start "
                                   "on a block boundary")
        if chunker.chunk_size % pool.layout.block_size:
            raise BlockLayoutError(f"block size {pool.layout.block_size} does not divide the chunk size "
                                   f"{chunker.chunk_size}")
        if cache.pool is not pool or (host is not None and host.device is not pool):
            raise BlockLayoutError("the block cache and host offload must keep blocks of this pool")
        self.chunker, self.pool, self.cache, self.slow, self.host = chunker, pool, cache, slow, host
        self.loaded = 0  # chunks loaded from the slow tiers into blocks
        self.load_failures: dict[str, int] = {}  # reason -> count (a failed load is a miss, never an error)

    # ---- lookup ---------------------------------------------------------------------------------------
    def lookup(self, ids: Sequence[int], salt: str | None, token_granular: bool = True,
               limit: int | None = None) -> PagedPlan:
        """Map the longest stored prefix of `ids` (whole chunks by key, then, when token_granular, the best stored
        sibling at token granularity) into a new table; at most `limit` positions (default len(ids) - 1: the
        last prompt token always runs)."""
        t0 = time.perf_counter()
        self.cache.trim()  # what earlier requests stored over budget while they held it
        ids = list(ids)
        plan = PagedPlan(BlockTable(self.pool), len(ids))
        for chunk in self.chunker.split(ids, salt):
            if chunk.complete and self._map_whole(plan, chunk):
                continue
            if token_granular:
                self._map_partial(plan, chunk, ids)
            break
        limit = max(len(ids) - 1, 0) if limit is None else limit
        if plan.table.length > limit:
            plan.table.truncate(limit)
        plan.reuse_len = plan.table.length
        plan.lookup_ms = (time.perf_counter() - t0) * 1e3
        return plan

    def _map_whole(self, plan: PagedPlan, chunk: Chunk) -> bool:
        hit = self.cache.acquire(chunk.prefix_key)
        if hit is None and self.host is not None:
            hit = self._restore(chunk.prefix_key)
        if hit is None and self.slow is not None:
            hit = self._load(chunk.prefix_key, chunk.token_ids, chunk.start, chunk.parent_key)
        if hit is None:
            return False
        if hit.token_ids != chunk.token_ids or hit.start != chunk.start:  # a key collision is not a hit
            self.pool.decref(hit.blocks)
            return False
        plan.table.map_shared(hit.blocks, hit.n_tokens, held=True)
        plan.chunks += 1
        plan.mapped.append((hit, hit.n_tokens))
        return True

    def _restore(self, key: str) -> CachedChunk | None:
        """A chunk from host memory back into device blocks, cached and acquired - one hold per block, the
        caller's (None: not offloaded, or the move failed - counted by the offload)."""
        if self.host is None:
            return None
        moved = self.host.restore(key)
        if moved is None:
            return None
        stored, blocks = moved
        try:  # the budget is enforced once the caller lets go (release / trim): see BlockCache.put
            self.cache.put(stored.key, blocks, stored.token_ids, stored.start, stored.parent_key, enforce_budget=False)
        finally:
            self.pool.decref(blocks)  # the cache holds them now
        return self.cache.acquire(key)

    def _load(self, key: str, token_ids: Sequence[int], start: int, parent_key: str | None) -> CachedChunk | None:
        """A chunk from the slow tiers into fresh blocks, cached and acquired (None: not there, or no room)."""
        assert self.slow is not None
        record = self.slow.get(key)
        if record is None or tuple(record.token_ids) != tuple(token_ids) or record.start != start:
            return None
        table = BlockTable(self.pool)
        try:
            load_record(table, record)
            self.cache.put(key, table.blocks, record.token_ids, start, parent_key, enforce_budget=False)
        except (BlockError, RuntimeError, ValueError, IndexError) as exc:  # out of blocks, a record of another shape
            reason = type(exc).__name__
            self.load_failures[reason] = self.load_failures.get(reason, 0) + 1
            return None
        finally:
            table.release()  # the cache holds the blocks now (or they are free again)
        self.loaded += 1
        return self.cache.acquire(key)

    def snapshot(self, chunk: Chunk, blocks: Sequence[int], pool: BlockPool | None = None) -> ChunkRecord:
        """The chunk's K/V copied out of its blocks (of `pool`, default the device pool), for the write-behind
        queue (the blocks may be reused before the writer runs)."""
        packed = (pool or self.pool).read_packed(blocks, chunk.end - chunk.start)
        return ChunkRecord.from_packed(chunk.prefix_key, chunk.parent_key, chunk.content_key, tuple(chunk.token_ids),
                                       chunk.start, packed)

    def _map_partial(self, plan: PagedPlan, chunk: Chunk, ids: list[int]) -> None:
        """The stored sibling of `chunk` (same parent, same start) agreeing longest with the prompt from there, on
        the device, (host offload) in host memory, or in the disk / Redis tiers (a prompt's partial last chunk,
        after a restart or from another process sharing them)."""
        best, agree = None, 0
        siblings: list[CachedChunk | ChunkMeta] = list(self.cache.children(chunk.parent_key))
        if self.host is not None:
            siblings += self.host.children(chunk.parent_key)
        if self.slow is not None:  # listed after the blocks: an equal match is taken from them
            siblings += self.slow.children(chunk.parent_key)
        for sibling in siblings:
            if sibling.start != chunk.start:
                continue
            n = common_prefix_length(sibling.token_ids, ids[chunk.start:])
            if n > agree:
                best, agree = sibling, n
        if best is None:
            return
        if not self.cache.contains(best.key):  # in host memory or a slow tier: into device blocks first
            moved = self._restore(best.key) if self.host is not None and self.host.contains(best.key) else None
            if moved is None and isinstance(best, ChunkMeta):
                moved = self._load(best.key, best.token_ids, best.start, best.parent_key)
            if moved is None:
                return
            self.pool.decref(moved.blocks)  # cached again; the holds this plan keeps are taken below
        hit = self.cache.acquire(best.key, agree)  # None if evicted since children() looked
        if hit is None:
            return
        plan.table.map_shared(hit.blocks[:self.pool.layout.blocks_for(agree)], agree, held=True)
        plan.chunks += 1
        plan.mapped.append((hit, agree))

    def segments(self, plan: PagedPlan) -> list[Segment]:
        """The plan's mapped chunks as store segments (for callers that read records: placement into a workspace,
        a batch's shared prefix), each record's per-layer K/V [kv_heads, n, d] read from its blocks: views of the
        pool for a one-block chunk (no copy), gathered copies otherwise. Valid while the plan's table holds them."""
        out, start = [], 0
        for chunk, n in plan.mapped:
            n = min(n, plan.reuse_len - start)
            if n <= 0:
                break
            out.append(Segment(self.record(chunk), start, n))
            start += n
        return out

    def record(self, chunk: CachedChunk) -> ChunkRecord:
        """A stored chunk as a ChunkRecord over its blocks (see segments()); its per-layer tensors are made when
        read (a 4k-token prompt has ~2,000 of them on a 30-layer model: building them all up front cost more
        than the lookup itself)."""
        keys = _LayerViews(self.pool, chunk, 0)
        values = _LayerViews(self.pool, chunk, 1)
        return ChunkRecord(chunk.key, chunk.parent_key, "", chunk.token_ids, chunk.start, keys, values)  # type: ignore[arg-type]

    # ---- reads by key (content reuse) -------------------------------------------------------------------
    def contains(self, key: str) -> bool:
        """Whether a chunk is stored in blocks, on the device or offloaded to the host."""
        return self.cache.contains(key) or (self.host is not None and self.host.contains(key))

    def acquire(self, key: str) -> CachedChunk | None:
        """A stored chunk by key with one hold per block, the caller's to drop (pool.decref(chunk.blocks));
        restored from the host if offloaded. None: not in blocks."""
        hit = self.cache.acquire(key)
        return hit if hit is not None else self._restore(key)

    def held_records(self) -> HeldRecords:
        return HeldRecords(self)

    # ---- the contiguous mirror (CPU) --------------------------------------------------------------------
    def place(self, plan: PagedPlan, workspace: KVWorkspace, resident: int = 0) -> None:
        """Copy positions [resident, reuse_len) of the plan's table into batch row 0.. of `workspace` (every row):
        per layer, the blocks' slices concatenated straight into the workspace (one cat per layer, no temporary).
        A gather (index, then permute into token order, then copy) moved the bytes three times: 2.4-2.8x slower at
        1k-7k tokens on CPU (SmolLM2's K/V shape, 1 thread: scripts/place_timing.py)."""
        lo, hi = resident, plan.reuse_len
        if hi <= lo:
            return
        runs = plan.table.runs(lo, hi)  # (block, offset in block, offset from lo, n)
        for layer in range(self.pool.layout.layers):
            keys, values = self.pool.keys(layer), self.pool.values(layer)  # [blocks, H, bs, d]
            with torch.no_grad():  # cat(out=) refuses inputs that require grad; a placement is never differentiated
                workspace.write_layer(layer, [keys[b, :, off:off + n] for b, off, _, n in runs],
                                      [values[b, :, off:off + n] for b, off, _, n in runs], lo)

    def release(self, table: BlockTable) -> None:
        """A sequence is done with its table: its holds go, and chunks it kept pinned over the budget are evicted
        (to the host, with host offload) now rather than inside the next request's lookup."""
        table.release()
        self.cache.trim()

    def clear(self) -> None:
        """Forget every stored chunk (blocks running sequences hold stay theirs)."""
        self.cache.clear()
        if self.host is not None:
            self.host.clear()

    def stats(self) -> dict:
        s = self.cache.stats()
        return {"loaded_from_slow_tiers": self.loaded, "load_failures": dict(self.load_failures),
                "block_size": self.pool.layout.block_size, "blocks": self.pool.num_blocks,
                "blocks_used": self.pool.num_used, "block_bytes": self.pool.layout.block_nbytes,
                "pool_bytes": self.pool.nbytes, "stored_chunks": s.entries, "stored_blocks": s.blocks,
                "stored_bytes": s.bytes, "budget_bytes": s.budget_bytes, "hits": s.hits, "misses": s.misses,
                "evictions": s.evictions, "pinned_skips": s.pinned_skips,
                "host": None if self.host is None else asdict(self.host.stats())}

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
    def write_back_from(self, source: KVReadable | KVWorkspace, ids: Sequence[int], salt: str | None, row: int = 0,
                        chunks: list[Chunk] | None = None, table: BlockTable | None = None) -> tuple[int, int]:
        """write_back for a sequence whose K/V sits in `source` (row `row`): `table` (a request's, mapping its
        stored prefix; kept) or a temporary one that maps the stored chain first, takes the rest from `source`
        and is released. Returns (new, existing)."""
        if chunks is None:
            chunks = self.chunker.split(list(ids), salt)
        if all(self.cache.contains(c.prefix_key) for c in chunks):  # the common case after a hit: nothing to do
            return 0, len(chunks)
        temporary = table is None
        if table is None:
            table = self.lookup(ids, salt, token_granular=False, limit=len(ids)).table
        try:
            if table.length < len(ids):
                self._absorb_from(source, table, len(ids), row)
            return self.write_back(table, ids, salt, chunks)
        finally:
            if temporary:
                table.release()
                self.cache.trim()

    def _absorb_from(self, source: KVReadable | KVWorkspace, table: BlockTable, end: int, row: int) -> None:
        if isinstance(source, KVWorkspace):
            self.absorb(table, source, end, row)  # straight from the buffers: no intermediate copy
            return
        start = table.length
        keys, values = source.read(start, end, row=row)
        table.reserve(end - start)
        for layer, (k, v) in enumerate(zip(keys, values)):
            table.write(layer, start, k, v)

    def write_back(self, table: BlockTable, ids: Sequence[int], salt: str | None,
                   chunks: list[Chunk] | None = None) -> tuple[int, int]:
        """Store every chunk of ids[:table.length] (or the given `chunks`, cut elsewhere) not stored yet as the
        table's blocks; returns (new, existing). A stored partial sibling that a new complete chunk extends is
        dropped (dead weight)."""
        n = min(table.length, len(ids))
        bs = self.pool.layout.block_size
        new = existing = 0
        if chunks is None:
            chunks = self.chunker.split(list(ids[:n]), salt)
        for chunk in chunks:
            if chunk.end > n:
                break
            if self.cache.contains(chunk.prefix_key):
                existing += 1
                continue
            if chunk.start % bs:
                raise BlockError(f"chunk at {chunk.start} does not start on a block boundary")
            blocks = table.blocks[chunk.start // bs:self.pool.layout.blocks_for(chunk.end)]
            if self.cache.put(chunk.prefix_key, blocks, chunk.token_ids, chunk.start, chunk.parent_key,
                              enforce_budget=False):
                new += 1
                if self.host is not None:
                    self.host.discard(chunk.prefix_key)  # recomputed while offloaded: one copy is enough
            if self.slow is not None and not self.slow.contains(chunk.prefix_key):
                self.slow.put(self.snapshot(chunk, blocks))  # written behind; a failing tier is counted there
            if chunk.complete:
                for sibling in self.cache.children(chunk.parent_key):
                    m = sibling.n_tokens
                    if m < chunk.end - chunk.start and sibling.token_ids == chunk.token_ids[:m]:
                        self.cache.delete(sibling.key)
        self.cache.trim()  # once for the run of puts (the table's own chunks stay until it lets go)
        return new, existing


class HeldRecords:
    """Stored chunks read by key, as content placement reads a store (reuse/assemble.py: contains, get): each
    get() holds the chunk's blocks until close(), so placing one piece cannot evict another piece's blocks
    (a restore from the host allocates). Use as a context manager."""

    def __init__(self, paged: PagedKV):
        self.paged = paged
        self.held: list[CachedChunk] = []

    def contains(self, key: str) -> bool:
        return self.paged.contains(key)

    def get(self, key: str) -> ChunkRecord | None:
        chunk = self.paged.acquire(key)
        if chunk is None:
            return None
        self.held.append(chunk)
        return self.paged.record(chunk)

    def close(self) -> None:
        for chunk in self.held:
            self.paged.pool.decref(chunk.blocks)
        self.held.clear()

    def __enter__(self) -> HeldRecords:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _LayerViews(Sequence[torch.Tensor]):
    """Layer i's K (kind 0) or V (kind 1) of a stored chunk, [kv_heads, n_tokens, d], made on access: a view of
    the pool for a one-block chunk, a gathered copy for a chunk spanning several blocks."""

    def __init__(self, pool: BlockPool, chunk: CachedChunk, kind: int):
        self.pool, self.chunk, self.kind = pool, chunk, kind

    def __len__(self) -> int:
        return self.pool.layout.layers

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        n, blocks = self.chunk.n_tokens, self.chunk.blocks
        if len(blocks) == 1:
            return self.pool.storage[blocks[0], i, self.kind, :, :n]
        ids = torch.tensor(blocks, device=self.pool.device)[None]
        kv = self.pool.gather(i % len(self), ids)[self.kind]
        return kv[0, :, :n]


def load_record(table: BlockTable, record: ChunkRecord) -> None:
    """A stored record's K/V into new positions at the end of `table` (which must end on a block boundary): a packed
    record (format 2) one copy per block, a per-layer one (format 1, or built in memory) per layer one slice copy per
    block. Raises BlockError (no room) or a shape error for a record that does not fit the blocks."""
    start = table.length
    table.reserve(record.n_tokens)
    packed = record.packed_view()
    if packed is not None:
        bs = table.pool.layout.block_size
        for j in range(table.pool.layout.blocks_for(record.n_tokens)):
            table.pool.write_packed(table.blocks[start // bs + j], 0, packed[:, :, :, j * bs:(j + 1) * bs])
    else:
        for layer, (k, v) in enumerate(zip(record.keys, record.values)):
            table.write(layer, start, k, v)


def build_paged_kv(chunker: Chunker, shapes: Sequence[LayerShape], dtype: torch.dtype, device: torch.device,
                   budget_bytes: int, block_size: int | None = None, max_context: int | None = None,
                   slow: ChunkStore | None = None, device_budget_bytes: int | None = None,
                   device_max_tokens: int | None = None) -> PagedKV:
    """A pool for the stored blocks' budget plus room for two sequences of max_context tokens (a request's table
    and a write-back's temporary one), and its cache. slow: the disk / Redis tiers behind the blocks (a store whose
    memory tier holds nothing), or None.

    device_budget_bytes None: one pool of `budget_bytes` of stored blocks. Otherwise the device pool keeps that
    much, and the chunks it evicts move to a host pool of `budget_bytes` (host offload) instead of being dropped.
    device_max_tokens: the longest sequence the device holds (longer ones are streamed from the host pool, which
    then has room for one such sequence beyond `budget_bytes`); the device's room for sequences is sized by it."""
    layout = BlockLayout.for_layers(shapes, block_size or chunker.chunk_size, dtype)
    longest = max_context or 32768
    on_device = longest if device_max_tokens is None else min(longest, device_max_tokens)
    running = 2 * (layout.blocks_for(on_device) + 1)
    stored = budget_bytes if device_budget_bytes is None else device_budget_bytes
    pool = BlockPool(layout, stored // layout.block_nbytes + running, device)
    host = None
    if device_budget_bytes is not None:
        streamed_room = layout.blocks_for(longest) + 1 if on_device < longest else 0
        host_pool = host_pool_for(pool, budget_bytes, streamed_room)
        if host_pool is not None:
            host = HostOffload(pool, host_pool, budget_blocks=budget_bytes // layout.block_nbytes)
    cache = BlockCache(pool, budget_bytes=stored, spill=None if host is None else host.stash)
    return PagedKV(chunker, pool, cache, slow, host)

