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


def test_one_write_backs_complete_chunks_view_one_span(engine):
    ids = engine.encode(words(70, seed=5))
    engine.warm_ids(ids)
    plan = engine.kv.lookup(ids + [7], None, GenerationMode.CHUNK_KV_REUSE)
    records = [s.record for s in plan.segments]
    complete, rest = records[:len(ids) // CHUNK], records[len(ids) // CHUNK:]
    span = complete[0].span
    assert len(complete) >= 3 and span is not None and span.start == 0
    assert all(r.span is span for r in complete)  # views of one read: no copy per chunk
    assert all(r.span is None for r in rest)  # the remainder alone: a complete chunk replaces it later
    for r in complete:
        a = r.start - span.start
        for i, (k, v) in enumerate(zip(r.keys, r.values)):
            assert k.untyped_storage().data_ptr() == span.keys[i].untyped_storage().data_ptr()
            assert torch.equal(k, span.keys[i][:, a:a + r.n_tokens])
            assert torch.equal(v, span.values[i][:, a:a + r.n_tokens])


def test_span_prefix_is_the_reuse_that_one_span_holds_from_position_zero(engine):
    from kvboost.kv.manager import span_prefix

    ids = engine.encode(words(70, seed=6))
    engine.warm_ids(ids[:40])  # one span: chunks [0, 32), remainder [32, 40)
    engine.warm_ids(ids)  # another write: [32, 48) onwards
    plan = engine.kv.lookup(ids, None, GenerationMode.CHUNK_KV_REUSE)
    span, n = span_prefix(plan)
    assert n == 2 * CHUNK and span is plan.segments[0].record.span
    resident = engine.kv.lookup(ids, None, GenerationMode.CHUNK_KV_REUSE, resident=ids[:20])
    assert resident.resident == 20 and span_prefix(resident) is None  # the workspace holds part of it


def test_placing_span_records_equals_placing_standalone_ones(engine):
    from kvboost.kv.workspace import KVWorkspace

    ids = engine.encode(words(90, seed=7))
    engine.warm_ids(ids)
    plan = engine.kv.lookup(ids, None, GenerationMode.CHUNK_KV_REUSE)
    assert any(s.record.span is not None for s in plan.segments)
    copies = Plan(plan.n_prompt, plan.reuse_len, segments=[
        type(s)(s.record.standalone(), s.start, s.n_tokens) for s in plan.segments])
    assert all(s.record.span is None for s in copies.segments)
    out = []
    for p in (plan, copies):
        ws = KVWorkspace(engine.workspace.shapes, engine.kv_dtype, engine.device)
        ws.ensure_capacity(len(ids), keep=0)
        engine.kv.place(p, ws, ids, skip_below=5)
        out.append(ws.read(0, plan.reuse_len))
    for a, b in zip(out[0][0] + out[0][1], out[1][0] + out[1][1]):
        assert torch.equal(a, b) and not a[:, :5].any() and a[:, 5:].any()  # below skip_below: not placed
