"""The block path against today's (KVCacheManager + MemoryStore): the same reuse, bit-identical logits, stored
chunks holding the same K/V, and exact hits that map stored blocks without copying them."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvboost.chunking import Chunker
from kvboost.config import EngineConfig
from kvboost.kv.block_cache import BlockCache
from kvboost.kv.blocks import BlockLayout, BlockLayoutError, BlockPool
from kvboost.kv.manager import KVCacheManager
from kvboost.kv.paged_kv import PagedKV
from kvboost.kv.workspace import KVWorkspace
from kvboost.model.forward import forward_tokens, probe_layer_shapes
from kvboost.results import GenerationMode
from kvboost.store.memory import MemoryStore

from ..prompts import words
from ..tiny_models import make_tiny_model

CHUNK = 16
NS = "paged-test"


class _Today:
    """generate() as the engine does it today: lookup, place stored chunks into the workspace, write back."""

    def __init__(self, model):
        self.model = model
        shapes, dtype = probe_layer_shapes(model)
        self.ws = KVWorkspace(shapes, dtype, next(model.parameters()).device)
        self.store = MemoryStore(10**9)
        self.kv = KVCacheManager(EngineConfig(chunk_size=CHUNK), NS, Chunker(CHUNK, NS), self.store, model)

    def generate(self, ids: list[int], n_new: int):
        plan = self.kv.lookup(ids, None, GenerationMode.CHUNK_KV_REUSE)
        self.ws.ensure_capacity(len(ids) + n_new, keep=0)
        self.kv.place(plan, self.ws, ids)
        logits, fed = _decode(self.model, self.ws, ids, plan.reuse_len, n_new)
        self.kv.write_back(fed, None, self.ws)
        return logits, plan.reuse_len


class _Paged:
    """The same through the block path: lookup maps blocks, place mirrors them, absorb + write_back keep them."""

    def __init__(self, model, block_size: int, num_blocks: int = 256, budget_blocks: int | None = None):
        self.model = model
        shapes, dtype = probe_layer_shapes(model)
        device = next(model.parameters()).device
        self.ws = KVWorkspace(shapes, dtype, device)
        self.pool = BlockPool(BlockLayout.for_layers(shapes, block_size, dtype), num_blocks, device)
        budget = None if budget_blocks is None else budget_blocks * self.pool.layout.block_nbytes
        self.cache = BlockCache(self.pool, budget_bytes=budget)
        self.kv = PagedKV(Chunker(CHUNK, NS), self.pool, self.cache)
        self.plans = []

    def generate(self, ids: list[int], n_new: int):
        plan = self.kv.lookup(ids, None)
        self.plans.append(plan)
        self.ws.ensure_capacity(len(ids) + n_new, keep=0)
        self.kv.place(plan, self.ws)
        logits, fed = _decode(self.model, self.ws, ids, plan.reuse_len, n_new)
        self.kv.absorb(plan.table, self.ws, len(fed))
        self.kv.write_back(plan.table, fed, None)
        plan.table.release()
        return logits, plan.reuse_len


def _decode(model, ws: KVWorkspace, ids: list[int], reuse: int, n_new: int):
    """Prefill ids[reuse:] over the workspace, then greedy steps; (logits per step, the ids fed to the model)."""
    cache = ws.make_cache(reuse)
    logits = [forward_tokens(model, ids[reuse:], cache)[0, -1]]
    fed = list(ids)
    for _ in range(n_new - 1):
        fed.append(int(logits[-1].argmax()))
        logits.append(forward_tokens(model, [fed[-1]], cache)[0, -1])
    return logits, fed


def _requests(tokenizer) -> list[list[int]]:
    a = tokenizer(words(40, seed=1))["input_ids"]
    c = a[:21] + tokenizer(words(12, seed=3))["input_ids"]  # agrees with a inside its second chunk only
    return [a, a + tokenizer(words(15, seed=2))["input_ids"], c, a, a[:CHUNK * 2 + 1]]


def _compare(model, tokenizer, block_size: int, **paged_kw):
    today, paged = _Today(model), _Paged(model, block_size, **paged_kw)
    reused = []
    for ids in _requests(tokenizer):
        want, want_reuse = today.generate(ids, n_new=5)
        got, got_reuse = paged.generate(ids, n_new=5)
        assert got_reuse == want_reuse
        assert all(torch.equal(g, w) for g, w in zip(got, want))
        reused.append(got_reuse)
    return today, paged, reused


@pytest.mark.parametrize("block_size", [CHUNK, CHUNK // 4])
def test_block_path_matches_todays_path(tokenizer, device, block_size):
    model = make_tiny_model("llama", tokenizer, device=device)
    today, paged, reused = _compare(model, tokenizer, block_size)
    assert reused[0] == 0 and reused[1] > 2 * CHUNK and CHUNK < reused[2] < 2 * CHUNK and reused[3] > 2 * CHUNK
    # Every stored chunk holds the same K/V as today's record of it, bit for bit.
    metas = today.store.metas()
    assert metas and {m.key for m in metas} == _all_keys(paged)
    for meta in metas:
        record = today.store.get(meta.key)
        chunk = paged.cache.get(meta.key)
        assert chunk.token_ids == record.token_ids
        ids = torch.tensor(chunk.blocks, device=device)[None]
        for layer in range(len(record.keys)):
            k, v = paged.pool.gather(layer, ids)
            assert torch.equal(k[0, :, :chunk.n_tokens], record.keys[layer])
            assert torch.equal(v[0, :, :chunk.n_tokens], record.values[layer])


def _all_keys(paged: _Paged) -> set[str]:
    seen, todo = set(), [paged.kv.chunker.root_key(None)]
    while todo:
        for c in paged.cache.children(todo.pop()):
            seen.add(c.key)
            todo.append(c.key)
    return seen


def test_exact_hit_maps_the_stored_blocks(tokenizer, device):
    model = make_tiny_model("qwen2", tokenizer, device=device)
    paged = _Paged(model, CHUNK)
    a = tokenizer(words(40, seed=1))["input_ids"]
    paged.generate(a, n_new=3)
    first = paged.kv.chunker.split(a, None)[0]
    stored = paged.cache.get(first.prefix_key).blocks
    before, snapshot = paged.pool.allocations, paged.pool.storage.clone()
    plan = paged.kv.lookup(a, None)
    assert plan.table.blocks[0] == stored[0] and paged.pool.refcount(stored[0]) == 2  # the cache's + this table's
    assert paged.pool.allocations == before  # nothing allocated, nothing written (bitwise: unallocated blocks
    assert torch.equal(paged.pool.storage.view(torch.int32), snapshot.view(torch.int32))  # may hold NaN)
    assert plan.reuse_len == len(a) - 1  # the last prompt token always runs
    plan.table.release()
    assert paged.pool.refcount(stored[0]) == 1


def test_small_pool_evicts_cold_chunks_and_stays_identical(tokenizer, device):
    model = make_tiny_model("llama", tokenizer, device=device)
    # Room for a few chunks beside the running sequence: later requests evict earlier chunks (never the ones
    # a running sequence maps), and outputs stay those of today's path over an unbounded store... except reuse,
    # which can only be lower; so compare against a fresh run of each request instead.
    paged = _Paged(model, CHUNK, num_blocks=9, budget_blocks=6)
    today = _Today(model)
    for ids in _requests(tokenizer):
        got, _ = paged.generate(ids, n_new=5)
        fresh = _Today(model)
        want, _ = fresh.generate(ids, n_new=5)
        today.generate(ids, n_new=5)
        assert [int(x.argmax()) for x in got] == [int(x.argmax()) for x in want]
        torch.testing.assert_close(torch.stack(got), torch.stack(want), atol=1e-4, rtol=1e-4)
    stats = paged.cache.stats()
    assert stats.evictions > 0 and stats.blocks <= 6 and paged.pool.num_used == stats.blocks


def test_paged_kv_refuses_unaligned_chunking():
    pool = BlockPool(BlockLayout(1, 1, 4, 12, torch.float32), 2)
    with pytest.raises(BlockLayoutError):
        PagedKV(Chunker(CHUNK, NS), pool, BlockCache(pool))
    pool16 = BlockPool(BlockLayout(1, 1, 4, 16, torch.float32), 2)
    windowed = Chunker(CHUNK, NS, boundary_window=4, boundary_classes=np.zeros(100, dtype=np.uint8))
    with pytest.raises(BlockLayoutError):
        PagedKV(windowed, pool16, BlockCache(pool16))


@pytest.mark.slow
def test_block_path_matches_todays_path_on_smollm2(smol):
    model, tokenizer = smol
    _compare(model, tokenizer, CHUNK // 2)


def test_place_skips_resident_positions(tokenizer, device):
    model = make_tiny_model("llama", tokenizer, device=device)
    paged = _Paged(model, CHUNK // 2)
    a = tokenizer(words(40, seed=1))["input_ids"]
    paged.generate(a, n_new=3)
    plan = paged.kv.lookup(a, None)
    full = KVWorkspace(paged.ws.shapes, paged.ws.dtype, device)
    full.ensure_capacity(len(a), keep=0)
    paged.kv.place(plan, full)
    part = KVWorkspace(paged.ws.shapes, paged.ws.dtype, device)
    part.ensure_capacity(len(a), keep=0)
    for layer in range(len(part.shapes)):  # the first 13 positions are already there (resident); poison the rest
        for src, dst in zip(full.buffers(layer), part.buffers(layer)):
            dst.fill_(float("nan"))
            dst[:, :, :13] = src[:, :, :13]
    paged.kv.place(plan, part, resident=13)
    for layer in range(len(part.shapes)):
        for src, dst in zip(full.buffers(layer), part.buffers(layer)):
            assert torch.equal(src[:, :, :plan.reuse_len], dst[:, :, :plan.reuse_len])
    plan.table.release()
