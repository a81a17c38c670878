"""Block pool, block tables and the block cache: holds, sharing without copies, copy on write, eviction."""
from __future__ import annotations

import pytest
import torch

from kvboost.kv.block_cache import BlockCache
from kvboost.kv.block_table import BlockTable, stack_tables
from kvboost.kv.blocks import (
    BlockError,
    BlockLayout,
    BlockLayoutError,
    BlockPool,
    DoubleFreeError,
    FreeBlockError,
    OutOfBlocksError,
)
from kvboost.kv.workspace import LayerShape

LAYERS, HEADS, DIM, BS = 3, 2, 4, 4


def _pool(num_blocks: int = 8) -> BlockPool:
    return BlockPool(BlockLayout(LAYERS, HEADS, DIM, BS, torch.float32), num_blocks)


def _kv(n: int, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-layer K and V [kv_heads, n, d] with values unique to the seed."""
    g = torch.Generator().manual_seed(seed)
    return ([torch.randn(HEADS, n, DIM, generator=g) for _ in range(LAYERS)],
            [torch.randn(HEADS, n, DIM, generator=g) for _ in range(LAYERS)])


def _append(table: BlockTable, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
    start = table.length
    table.reserve(keys[0].shape[1])
    for layer, (k, v) in enumerate(zip(keys, values)):
        table.write(layer, start, k, v)


def _read(table: BlockTable, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids, lengths = stack_tables([table], "cpu")
    k, v = table.pool.gather(layer, ids)
    return k[0, :, : table.length], v[0, :, : table.length]


# ---- layout and pool ------------------------------------------------------------------------------------
def test_layout_from_layers_and_one_region_per_block():
    layout = BlockLayout.for_layers([LayerShape(2, 4, 4)] * 3, block_size=4, dtype=torch.float16)
    assert layout.block_shape == (3, 2, 2, 4, 4) and layout.block_nbytes == 3 * 2 * 2 * 4 * 4 * 2
    with pytest.raises(BlockLayoutError):
        BlockLayout.for_layers([LayerShape(2, 4, 4), LayerShape(1, 4, 4)], 4, torch.float16)
    with pytest.raises(BlockLayoutError):
        BlockLayout.for_layers([LayerShape(2, 4, 8)], 4, torch.float16)
    pool = _pool()
    assert pool.storage[3].is_contiguous() and pool.storage[3].numel() * 4 == pool.layout.block_nbytes
    # Moving a block moves every layer's K and V: one copy.
    a, b = pool.allocate(2)
    pool.storage[a].normal_()
    pool.copy_block(a, b)
    assert torch.equal(pool.storage[a], pool.storage[b])


def test_allocate_free_and_typed_misuse():
    pool = _pool(4)
    got = pool.allocate(3)
    assert len(set(got)) == 3 and pool.num_free == 1 and all(pool.refcount(b) == 1 for b in got)
    with pytest.raises(OutOfBlocksError):
        pool.allocate(2)
    assert pool.num_free == 1  # all or nothing: the failed allocation holds nothing
    assert pool.decref(got[0]) == [got[0]] and pool.num_free == 2
    with pytest.raises(DoubleFreeError):
        pool.decref(got[0])
    with pytest.raises(DoubleFreeError):  # checked before any change: got[1] is not released either
        pool.decref([got[1], got[1]])
    assert pool.refcount(got[1]) == 1
    with pytest.raises(FreeBlockError):  # a free block cannot be revived by sharing it
        pool.incref(got[0])
    with pytest.raises(FreeBlockError):
        pool.copy_block(got[0], got[1])
    with pytest.raises(BlockError):
        pool.refcount(99)


def test_a_held_block_is_never_handed_out_again():
    """A block a sequence reads cannot be freed or reallocated: held blocks never reach the free list."""
    pool = _pool(4)
    reader = BlockTable(pool)
    keys, values = _kv(6, seed=1)
    _append(reader, keys, values)
    shared = reader.fork()
    shared.release()  # another holder lets go: the reader's blocks stay held
    assert all(pool.refcount(b) == 1 for b in reader.blocks)
    others = pool.allocate(pool.num_free)
    assert not set(others) & set(reader.blocks)
    with pytest.raises(OutOfBlocksError):
        pool.allocate(1)
    for layer in range(LAYERS):
        k, v = _read(reader, layer)
        assert torch.equal(k, keys[layer]) and torch.equal(v, values[layer])


def test_allocated_blocks_start_zeroed():
    """A reused block never shows its previous holder's K/V (nor uninitialised memory) in its unwritten slots."""
    pool = _pool(2)
    for _ in range(2):
        blocks = pool.allocate(2)
        assert pool.storage[blocks].abs().sum() == 0
        pool.storage[blocks] = float("nan")
        pool.decref(blocks)


# ---- block tables ---------------------------------------------------------------------------------------
def test_write_and_gather_over_non_contiguous_blocks():
    pool = _pool(8)
    spacer = pool.allocate(1)  # the table's blocks are not 0, 1, 2...
    table = BlockTable(pool)
    keys, values = _kv(10, seed=2)
    _append(table, [k[:, :3] for k in keys], [v[:, :3] for v in values])  # a partial block, then more
    pool.allocate(1)
    _append(table, [k[:, 3:] for k in keys], [v[:, 3:] for v in values])
    assert table.length == 10 and len(table.blocks) == 3 and spacer[0] not in table.blocks
    assert table.blocks[1] - table.blocks[0] > 1  # another sequence's block sits between them
    for layer in range(LAYERS):
        k, v = _read(table, layer)
        assert torch.equal(k, keys[layer]) and torch.equal(v, values[layer])
    table.release()
    assert table.length == 0 and not table.blocks and pool.num_free == 6


def test_slot_writes_equal_run_writes():
    """BlockPool.write (slots as a tensor: the form a captured step can use) writes what the table's runs write."""
    pool = _pool(8)
    table = BlockTable(pool)
    pool.allocate(1)
    table.reserve(11)
    keys, values = _kv(11, seed=11)
    for layer in range(LAYERS):
        table.write(layer, 0, keys[layer], values[layer])
    by_runs = pool.storage[table.blocks].clone()
    pool.storage[table.blocks] = 0
    for layer in range(LAYERS):
        pool.write(layer, table.slots(0, 11), keys[layer], values[layer])
    assert torch.equal(pool.storage[table.blocks], by_runs)
    assert table.runs(3, 11) == [(table.blocks[0], 3, 0, 1), (table.blocks[1], 0, 1, 4), (table.blocks[2], 0, 5, 3)]


def test_exact_hit_maps_blocks_without_copying():
    pool = _pool(8)
    cache = BlockCache(pool)
    writer = BlockTable(pool)
    keys, values = _kv(2 * BS, seed=3)
    _append(writer, keys, values)
    assert cache.put("chunk", writer.blocks, range(2 * BS), start=0)  # write-back keeps the blocks: no clone
    writer.release()
    assert pool.num_used == 2  # only the cache holds them now
    before = pool.storage.clone()
    reader = BlockTable(pool)
    hit = cache.get("chunk")
    reader.map_shared(hit.blocks, hit.n_tokens)
    # Bitwise: never-allocated blocks are uninitialised memory, which may hold NaN (NaN != NaN).
    assert reader.blocks == list(hit.blocks) and torch.equal(pool.storage.view(torch.int32), before.view(torch.int32))
    assert pool.num_used == 2 and all(pool.refcount(b) == 2 for b in hit.blocks)
    with pytest.raises(BlockError):  # a mapped full block is read-only to this sequence
        reader.write(0, 0, keys[0][:, :1], values[0][:, :1])
    more_k, more_v = _kv(1, seed=4)
    _append(reader, more_k, more_v)  # the next position starts a block of the reader's own: no copy on write
    assert reader.cow_copies == 0 and reader.blocks[:2] == list(hit.blocks)
    for layer in range(LAYERS):
        k, _ = _read(reader, layer)
        assert torch.equal(k, torch.cat([keys[layer], more_k[layer]], 1))


def test_partially_filled_shared_block_is_copied_on_write():
    pool = _pool(8)
    cache = BlockCache(pool)
    writer = BlockTable(pool)
    keys, values = _kv(BS + 2, seed=5)  # a full block and a partial one (2 of 4 slots)
    _append(writer, keys, values)
    cache.put("tail", writer.blocks, range(BS + 2), start=0)
    partial = writer.blocks[-1]
    stored = pool.storage[partial].clone()
    new_k, new_v = _kv(3, seed=6)
    _append(writer, new_k, new_v)  # the writer's last block is shared with the cache: it copies it first
    assert writer.cow_copies == 1 and writer.blocks[-2] != partial and pool.refcount(partial) == 1
    assert torch.equal(pool.storage[partial], stored)  # what the cache holds did not change
    for layer in range(LAYERS):
        k, v = _read(writer, layer)
        assert torch.equal(k, torch.cat([keys[layer], new_k[layer]], 1))
        assert torch.equal(v, torch.cat([values[layer], new_v[layer]], 1))
    reader = BlockTable(pool)
    reader.map_shared(cache.get("tail").blocks, BS + 2)
    with pytest.raises(BlockError):  # mapping further requires a block boundary
        reader.map_shared([writer.blocks[0]], BS)
    for layer in range(LAYERS):
        k, _ = _read(reader, layer)
        assert torch.equal(k, keys[layer])


def test_fork_shares_then_diverges():
    pool = _pool(8)
    a = BlockTable(pool)
    keys, values = _kv(3, seed=7)
    _append(a, keys, values)
    b = a.fork()
    assert b.blocks == a.blocks and pool.refcount(a.blocks[0]) == 2 and pool.num_used == 1
    ka, va = _kv(1, seed=8)
    kb, vb = _kv(1, seed=9)
    _append(a, ka, va)
    _append(b, kb, vb)
    assert a.cow_copies + b.cow_copies == 1  # the first writer copies; the last holder writes in place
    assert a.blocks != b.blocks
    assert torch.equal(_read(a, 1)[0], torch.cat([keys[1], ka[1]], 1))
    assert torch.equal(_read(b, 1)[0], torch.cat([keys[1], kb[1]], 1))


def test_reserve_is_all_or_nothing_and_truncate_releases():
    pool = _pool(3)
    table = BlockTable(pool)
    table.reserve(2 * BS)
    with pytest.raises(OutOfBlocksError):
        table.reserve(2 * BS)
    assert table.length == 2 * BS and len(table.blocks) == 2 and pool.num_free == 1
    table.truncate(BS + 1)
    assert len(table.blocks) == 2 and pool.num_free == 1
    table.truncate(BS)
    assert len(table.blocks) == 1 and pool.num_free == 2
    with pytest.raises(BlockError):
        table.truncate(BS + 1)


# ---- the block cache and eviction -----------------------------------------------------------------------
def _stored(cache: BlockCache, key: str, start: int = 0) -> list[int]:
    """A one-block chunk written by a sequence that then finished: only the cache holds it."""
    table = BlockTable(cache.pool)
    keys, values = _kv(BS, seed=hash(key) % 1000)
    _append(table, keys, values)
    cache.put(key, table.blocks, range(start, start + BS), start=start)
    blocks = list(table.blocks)
    table.release()
    return blocks


def test_a_chunk_a_running_sequence_reads_is_never_evicted():
    pool = _pool(4)
    cache = BlockCache(pool, budget_bytes=2 * pool.layout.block_nbytes)
    blocks = _stored(cache, "read")
    reader = BlockTable(pool)
    reader.map_shared(blocks, BS)
    content = pool.storage[blocks[0]].clone()
    for i in range(3):  # over budget each time: the coldest unpinned chunk goes, never the pinned one
        _stored(cache, f"other{i}")
    assert cache.contains("read") and cache.pinned("read") and cache.stats().pinned_skips > 0
    # The pool runs dry: its evictor frees what it can, but not the block the reader holds.
    grabbed = pool.allocate(pool.num_free + 1)
    assert blocks[0] not in grabbed and pool.refcount(blocks[0]) == 2
    with pytest.raises(OutOfBlocksError):
        pool.allocate(1)
    assert cache.contains("read") and torch.equal(pool.storage[blocks[0]], content)
    pool.decref(grabbed)
    reader.release()  # unpinned now: the next pressure may take it
    assert not cache.pinned("read")
    assert cache.evict_blocks(pool.num_blocks) >= 1 and not cache.contains("read")
    assert pool.num_free == pool.num_blocks


def test_block_cache_follows_lfu_with_aging():
    pool = _pool(16)
    cache = BlockCache(pool, budget_bytes=4 * pool.layout.block_nbytes)
    _stored(cache, "system")
    for i in range(30):
        assert cache.get("system") is not None  # every request hits the system prompt
        _stored(cache, f"oneoff{i}")
    assert cache.contains("system") and cache.stats().blocks <= 4
    # Among equally cold chunks the deeper one (a chain's tail) goes first.
    cache.clear()
    assert pool.num_free == pool.num_blocks
    _stored(cache, "head", start=0)
    _stored(cache, "tail", start=BS)
    cache.evict_blocks(1)
    assert cache.contains("head") and not cache.contains("tail")


def test_cache_refuses_free_blocks_and_delete_keeps_readers_safe():
    pool = _pool(4)
    cache = BlockCache(pool)
    table = BlockTable(pool)
    table.reserve(BS)
    freed = pool.allocate(1)
    pool.decref(freed)
    with pytest.raises(FreeBlockError):
        cache.put("dead", freed, range(BS), start=0)
    with pytest.raises(BlockError):
        cache.put("wrong", table.blocks, range(BS + 1), start=0)
    cache.put("live", table.blocks, range(BS), start=0, parent_key="root")
    assert [c.key for c in cache.children("root")] == ["live"]
    assert cache.delete("live") and not cache.delete("live") and not cache.children("root")
    assert pool.refcount(table.blocks[0]) == 1  # the sequence's own hold remains


def test_packed_records_move_in_one_copy_per_block():
    pool = _pool()
    g = torch.Generator().manual_seed(3)
    packed = torch.randn(LAYERS, 2, HEADS, BS + 2, DIM, generator=g)  # 1.5 blocks of every layer's K and V
    a, b = pool.allocate(2)
    pool.write_packed(a, 0, packed[:, :, :, :BS])
    pool.write_packed(b, 0, packed[:, :, :, BS:])
    assert torch.equal(pool.read_packed([a, b], BS + 2), packed)
    assert torch.equal(pool.keys(1)[b, :, :2], packed[1, 0, :, BS:]) and not pool.values(2)[b, :, 2:].any()
    with pytest.raises(BlockLayoutError):  # another head count
        pool.write_packed(a, 0, packed[:, :, :1])
    with pytest.raises(BlockLayoutError):  # past the block's end
        pool.write_packed(a, 2, packed[:, :, :, :BS])
    with pytest.raises(BlockLayoutError):
        pool.read_packed([a], BS + 1)
    pool.decref([a, b])
    with pytest.raises(FreeBlockError):
        pool.read_packed([a], 1)
