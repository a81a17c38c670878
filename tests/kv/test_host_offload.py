"""Host offload: chunks the device pool evicts move to a host pool and come back on a hit, bit for bit; a move
that fails is counted and costs a recompute, never a wrong output or a leaked block."""
from __future__ import annotations

import pytest
import torch

from kvboost import KVBoost
from kvboost.chunking import Chunker
from kvboost.kv.block_cache import BlockCache
from kvboost.kv.block_table import BlockTable
from kvboost.kv.blocks import BlockLayout, BlockLayoutError, BlockPool, OutOfBlocksError
from kvboost.kv.host_offload import HostOffload
from kvboost.kv.paged_kv import build_paged_kv
from kvboost.kv.workspace import LayerShape

from ..prompts import text_with_tokens, words
from ..tiny_models import make_tiny_model

LAYOUT = BlockLayout(2, 2, 4, 4, torch.float32)
CHUNK = 16


def _tiers(device_blocks: int = 3, host_blocks: int = 2):
    device, host = BlockPool(LAYOUT, device_blocks), BlockPool(LAYOUT, host_blocks)
    offload = HostOffload(device, host)
    return device, host, offload, BlockCache(device, spill=offload.stash)


def _store(cache: BlockCache, key: str, seed: int) -> torch.Tensor:
    """A one-block chunk with contents unique to the seed, stored in the device cache; returns the contents."""
    (block,) = cache.pool.allocate(1)
    cache.pool.storage[block].copy_(torch.randn(LAYOUT.block_shape, generator=torch.Generator().manual_seed(seed)))
    contents = cache.pool.storage[block].clone()
    cache.put(key, [block], tuple(range(seed, seed + 4)), start=4 * seed)
    cache.pool.decref([block])  # the cache's hold is the only one
    return contents


def test_evicted_chunks_move_to_the_host_and_back_bit_for_bit():
    device, host, offload, cache = _tiers()
    kept = {key: _store(cache, key, seed) for seed, key in enumerate("abc")}
    taken = device.allocate(2)  # the device runs short: the two coldest chunks (the deepest) move to the host
    moved = [k for k in "abc" if offload.contains(k)]
    assert moved == ["b", "c"] and cache.contains("a") and not cache.contains("b") and not cache.contains("c")
    assert offload.stats().offloaded == 2 and host.num_free == 0 and device.num_free == 0

    device.decref(taken)
    chunk, blocks = offload.restore("c")
    assert (chunk.key, chunk.token_ids, chunk.start) == ("c", (2, 3, 4, 5), 8)
    assert torch.equal(device.storage[blocks[0]], kept["c"])
    assert not offload.contains("c") and host.num_free == 1 and offload.stats().restored == 1
    device.decref(blocks)


def test_the_host_budget_evicts_its_coldest_chunk():
    device, host, offload, cache = _tiers(device_blocks=1, host_blocks=2)
    for seed, key in enumerate("abcd"):  # each new chunk evicts the previous one from the one-block device
        _store(cache, key, seed)
    s = offload.stats()
    assert s.offloaded == 3 and s.evictions == 1 and s.entries == 2
    assert [k for k in "abc" if offload.contains(k)] == ["a", "c"]  # among equals the deeper chunk goes first
    assert offload.restore("b") is None


def test_a_failed_copy_to_the_host_is_counted_and_leaks_nothing(monkeypatch):
    device, host, offload, cache = _tiers()
    _store(cache, "a", 0)

    def out_of_pinned_memory(*_):
        raise RuntimeError("CUDA error: out of memory (pinned host allocation)")

    monkeypatch.setattr(host, "copy_from", out_of_pinned_memory)
    device.allocate(3)  # evicts "a"
    assert not cache.contains("a") and not offload.contains("a")
    assert offload.stats().failures == {"copy_to_host": 1} and host.num_free == 2


def test_a_restore_without_device_room_keeps_the_host_copy():
    device, host, offload, cache = _tiers(device_blocks=1)
    _store(cache, "a", 0)
    table = BlockTable(device)
    table.reserve(4)  # a running sequence takes the only device block: "a" goes to the host
    assert offload.contains("a")
    assert offload.restore("a") is None and offload.contains("a")
    assert offload.stats().failures == {"device_full": 1}
    table.release()
    chunk, blocks = offload.restore("a")
    assert chunk.key == "a" and device.num_free == 0
    device.decref(blocks)


def test_a_chunk_a_sequence_reads_is_never_offloaded_from_under_it():
    device, host, offload, cache = _tiers(device_blocks=2)
    contents = _store(cache, "a", 0)
    hit = cache.acquire("a")  # a running sequence holds its block
    _store(cache, "b", 1)
    device.allocate(1)  # room is made by moving "b" out; "a" is pinned
    assert offload.contains("b") and not offload.contains("a") and cache.contains("a")
    with pytest.raises(OutOfBlocksError):
        device.allocate(1)  # nothing evictable is left
    assert cache.contains("a") and torch.equal(device.storage[hit.blocks[0]], contents)
    device.decref(list(hit.blocks))


def test_layouts_must_match():
    with pytest.raises(BlockLayoutError):
        HostOffload(BlockPool(LAYOUT, 2), BlockPool(BlockLayout(2, 2, 4, 8, torch.float32), 2))


# ---- through the engine ----------------------------------------------------------------------------------
def _engine(model, tokenizer, chunks_on_device: int, **kw) -> KVBoost:
    engine = KVBoost(model, tokenizer, chunk_size=CHUNK, paged_kv=True, **kw)
    block = engine.cache_stats()["paged_kv"]["block_bytes"]
    return KVBoost(model, tokenizer, chunk_size=CHUNK, paged_kv=True, device_kv_budget_bytes=chunks_on_device * block,
                   **kw)


def test_engine_serves_offloaded_prefixes_identically(tokenizer):
    model = make_tiny_model("llama", tokenizer)
    plain = KVBoost(model, tokenizer, chunk_size=CHUNK)
    engine = _engine(model, tokenizer, chunks_on_device=2)
    first, second = text_with_tokens(tokenizer, 6 * CHUNK, seed=1), text_with_tokens(tokenizer, 6 * CHUNK, seed=2)
    assert engine.warm(first).chunks_stored >= 6
    engine.warm(second)  # pushes the first prefix out to the host
    host = engine.cache_stats()["paged_kv"]["host"]
    assert host["offloaded"] >= 5 and host["entries"] >= 5
    prompt = first + " " + words(6, seed=9)
    engine.forget_workspace()
    got = engine.generate(prompt, max_new_tokens=8, return_logits=True)
    want = plain.generate(prompt, max_new_tokens=8, mode="baseline", return_logits=True)
    assert got.output_token_ids == want.output_token_ids and got.cached_tokens >= 5 * CHUNK
    assert torch.allclose(got.first_token_logits, want.first_token_logits, atol=1e-5)
    assert engine.cache_stats()["paged_kv"]["host"]["restored"] >= 5


def test_engine_recomputes_when_the_host_copy_fails(tokenizer, monkeypatch):
    model = make_tiny_model("llama", tokenizer)
    plain = KVBoost(model, tokenizer, chunk_size=CHUNK)
    engine = _engine(model, tokenizer, chunks_on_device=2)
    host_pool = engine.kv.blocks.host.host

    def out_of_pinned_memory(*_):
        raise RuntimeError("out of pinned memory")

    monkeypatch.setattr(host_pool, "copy_from", out_of_pinned_memory)
    first = text_with_tokens(tokenizer, 6 * CHUNK, seed=3)
    engine.warm(first)
    engine.warm(text_with_tokens(tokenizer, 6 * CHUNK, seed=4))
    prompt = first + " " + words(6, seed=8)
    engine.forget_workspace()
    got = engine.generate(prompt, max_new_tokens=8)
    assert got.output_token_ids == plain.generate(prompt, max_new_tokens=8, mode="baseline").output_token_ids
    host = engine.cache_stats()["paged_kv"]["host"]
    assert host["failures"].get("copy_to_host", 0) >= 5 and host["entries"] == 0
    assert got.cached_tokens < 6 * CHUNK  # recomputed, not served from a half-made copy


def test_device_budget_needs_paged_kv(tokenizer, device):
    model = make_tiny_model("llama", tokenizer)
    # Without paged_kv it no longer is refused: it is the unpaged store's device tier (tests/store/test_host_tier.py).
    unpaged = KVBoost(model, tokenizer, device_kv_budget_bytes=1 << 20, memory_budget_bytes=16 << 20)
    stats = unpaged.cache_stats()
    assert stats["tiers"]["host"]["budget_bytes"] == 16 << 20 and "paged_kv" not in stats
    with pytest.raises(ValueError, match="device_kv_budget_bytes"):
        KVBoost(model, tokenizer, paged_kv=True, device_kv_budget_bytes=-1)
    # device_kv_budget_bytes left to its default; a small memory budget, since on CUDA it is pinned host memory
    engine = KVBoost(model, tokenizer, paged_kv=True, memory_budget_bytes=16 << 20)
    paged = engine.cache_stats()["paged_kv"]
    if device.type != "cuda":
        assert paged["host"] is None  # the default elsewhere than CUDA: the device is host memory
    else:  # the default on CUDA (device_kv_budget): offload on, the chunks' host pool holds memory_budget_bytes
        assert paged["host"] is not None and paged["host"]["entries"] == 0
        assert paged["host"]["budget_bytes"] == (16 << 20) // paged["block_bytes"] * paged["block_bytes"]


def test_chunks_stored_over_budget_while_pinned_go_once_released():
    device, host, offload, cache = _tiers(device_blocks=4, host_blocks=4)
    cache.budget_bytes = LAYOUT.block_nbytes  # one block's worth
    table = BlockTable(device)
    table.reserve(12)  # a sequence of three blocks, each stored as a chunk while the sequence holds them
    for i, block in enumerate(table.blocks):
        cache.put(f"k{i}", [block], tuple(range(4 * i, 4 * i + 4)), start=4 * i)
    assert cache.stats().entries == 3 and offload.stats().offloaded == 0  # pinned: put() could not evict
    table.release()
    assert cache.trim() == 2 and cache.stats().entries == 1 and offload.stats().offloaded == 2


def test_restoring_a_long_prefix_walks_no_pinned_chunk_until_release():
    """Each restored chunk is pinned by the request's table as soon as it is mapped: enforcing the budget at every
    put walked all of them again (quadratic: 65 ms of bookkeeping for a 30k-token prefix). Now the lookup offers
    none to eviction, and the release moves them all out again."""
    chunker = Chunker(CHUNK, "ns")
    paged = build_paged_kv(chunker, [LayerShape(2, 4, 4)] * 2, torch.float32, torch.device("cpu"),
                           budget_bytes=1 << 20, device_budget_bytes=1, max_context=64 * CHUNK)
    ids = list(range(1000, 1000 + 60 * CHUNK))
    table = BlockTable(paged.pool)
    table.reserve(len(ids))
    for layer in range(2):
        keys = torch.randn(2, len(ids), 4, generator=torch.Generator().manual_seed(layer))
        table.write(layer, 0, keys, -keys)
    contents = paged.pool.storage[list(table.blocks)].clone()
    assert paged.write_back(table, ids, None) == (60, 0)
    paged.release(table)
    assert paged.cache.stats().entries == 0 and paged.host.stats().entries == 60  # all out to the host
    skips = paged.cache.stats().pinned_skips

    plan = paged.lookup(ids + [7], None)
    assert plan.reuse_len == len(ids) and paged.host.stats().restored == 60
    assert paged.cache.stats().pinned_skips == skips  # the lookup offered nothing to eviction
    assert torch.equal(paged.pool.storage[list(plan.table.blocks)], contents)  # bit for bit back
    paged.release(plan.table)
    stats = paged.cache.stats()
    assert stats.pinned_skips == skips and stats.entries == 0 and paged.host.stats().entries == 60


def test_token_granular_matches_come_back_from_the_host_too(tokenizer):
    model = make_tiny_model("llama", tokenizer)
    plain = KVBoost(model, tokenizer, chunk_size=CHUNK)
    engine = _engine(model, tokenizer, chunks_on_device=0)
    prefix = text_with_tokens(tokenizer, 3 * CHUNK + CHUNK // 2, seed=5)  # ends in a partial chunk
    ids = engine.encode(prefix)
    engine.warm_ids(ids)
    assert engine.cache_stats()["paged_kv"]["stored_chunks"] == 0  # everything went to the host
    prompt = ids + engine.encode(" " + words(5, seed=6))
    got = engine.generate(input_ids=prompt, max_new_tokens=6)
    assert got.cached_tokens == len(ids)  # the partial last chunk too, at token granularity
    assert got.output_token_ids == plain.generate(input_ids=prompt, max_new_tokens=6, mode="baseline").output_token_ids
    stats = engine.cache_stats()["paged_kv"]
    assert stats["host"]["restored"] == 4 and stats["blocks_used"] == stats["stored_blocks"]


def test_a_finished_request_moves_its_chunks_out_at_once(tokenizer):
    model = make_tiny_model("llama", tokenizer)
    # Over a table the request's own blocks become the stored chunks, held by it until it ends.
    engine = _engine(model, tokenizer, chunks_on_device=2, paged_attention="table")
    prefix = text_with_tokens(tokenizer, 6 * CHUNK, seed=11)
    engine.generate(prefix + " " + words(4, seed=12), max_new_tokens=4)  # stores ~6 chunks while holding them
    stats = engine.cache_stats()["paged_kv"]
    assert stats["stored_bytes"] <= stats["budget_bytes"]  # no later lookup needed: the release trimmed
    assert stats["host"]["entries"] >= 4
