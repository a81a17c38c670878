"""KVCacheManager: lookup plans without writing, place copies only what the workspace lacks, write_back stores
each chunk once per tenant, stats count every path."""
from __future__ import annotations

import pytest
import torch

from kvboost import GenerationMode, KVBoost
from kvboost.kv.manager import Plan

from ..prompts import words
from ..tiny_models import make_tiny_model

CHUNK = 16


@pytest.fixture
def engine(tokenizer):
    return KVBoost(make_tiny_model("llama", tokenizer), tokenizer, chunk_size=CHUNK)


def test_lookup_reads_only_and_finds_the_stored_chain(engine):
    ids = engine.encode(words(60, seed=1))
    assert engine.kv.lookup(ids, None, GenerationMode.CHUNK_KV_REUSE).reuse_len == 0
    engine.warm_ids(ids)
    stored = engine.cache_stats()["tiers"]["memory"]["entries"]
    for mode, expected in ((GenerationMode.CHUNK_KV_REUSE, len(ids) - 1),
                           (GenerationMode.PREFIX_CACHE, (len(ids) - 1) // CHUNK * CHUNK),
                           (GenerationMode.BASELINE, 0)):
        plan = engine.kv.lookup(ids, None, mode)
        assert isinstance(plan, Plan) and plan.reuse_len == expected and plan.resident == 0
        assert sum(min(s.end, plan.reuse_len) - s.start for s in plan.segments) == plan.reuse_len
    assert engine.cache_stats()["tiers"]["memory"]["entries"] == stored


def test_resident_positions_are_not_copied(engine):
    ids = engine.encode(words(60, seed=2))
    engine.warm_ids(ids)
    plan = engine.kv.lookup(ids, None, GenerationMode.CHUNK_KV_REUSE, resident=ids[:40])
    assert plan.resident == 40 and all(s.end > 40 for s in plan.segments)
    skipped = engine.kv.lookup(ids, None, GenerationMode.CHUNK_KV_REUSE, skip_before=2 * CHUNK)
    assert skipped.reuse_len == len(ids) - 1 and all(s.start >= 2 * CHUNK for s in skipped.segments)


def test_place_writes_the_stored_kv_into_one_row(engine):
    from kvboost.kv.workspace import KVWorkspace

    ids = engine.encode(words(50, seed=3))
    engine.warm_ids(ids)
    ws = KVWorkspace(engine.workspace.shapes, engine.kv_dtype, engine.device, batch_size=2)
    ws.ensure_capacity(len(ids), keep=0)
    plan = engine.kv.lookup(ids, None, GenerationMode.CHUNK_KV_REUSE)
    engine.kv.place(plan, ws, ids, row=1)
    keys, _ = ws.read(0, plan.reuse_len, row=1)
    want, _ = engine.workspace.read(0, plan.reuse_len)  # warm left the computed K/V resident there
    assert all(torch.equal(a, b) for a, b in zip(keys, want))
    untouched, _ = ws.read(0, plan.reuse_len, row=0)
    assert all(not k.any() for k in untouched)


def test_write_back_stores_each_chunk_once_per_tenant(engine):
    ids = engine.encode(words(50, seed=4))
    with torch.inference_mode():
        new, existing = engine.warm_ids(ids, "a")
        assert new == -(-len(ids) // CHUNK) and existing == 0
        assert engine.kv.write_back(ids, "a", engine.workspace) == (0, new)
        assert engine.warm_ids(ids, "b")[0] == new  # another tenant: its own chunks
    assert engine.kv.lookup(ids, "c", GenerationMode.CHUNK_KV_REUSE).reuse_len == 0


def test_stats_count_single_and_batched_requests(engine):
    prompt = words(40, seed=5)
    engine.generate(prompt, 3)
    engine.generate_batch([prompt, prompt + " more"], 3)
    stats = engine.cache_stats()
    assert stats["requests"] == 3 and stats["requests_by_mode"] == {"chunk_kv_reuse": 3}
    assert stats["cached_tokens"] > 0 and stats["chunks_written"] > 0 and stats["workspace_bytes"] > 0
