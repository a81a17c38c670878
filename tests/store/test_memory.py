from __future__ import annotations

import pytest
import torch

from kvboost.store.base import ChunkRecord
from kvboost.store.memory import MemoryStore


def record(key: str, parent: str | None = None, n: int = 8, start: int = 0, tokens=None) -> ChunkRecord:
    tokens = tuple(tokens) if tokens is not None else tuple(range(start, start + n))
    kv = [torch.zeros(2, n, 4) for _ in range(2)]
    return ChunkRecord(key, parent, "c" + key, tokens, start, kv, [t.clone() for t in kv])


def test_bytes_are_accounted_and_budget_enforced():
    one = record("a").nbytes
    store = MemoryStore(budget_bytes=3 * one)
    for k in "abcd":
        store.put(record(k))
    s = store.stats()
    assert s.entries == 3 and s.bytes == 3 * one and s.evictions == 1


def test_hot_chunk_survives_a_stream_of_one_off_chunks():
    one = record("x").nbytes
    store = MemoryStore(budget_bytes=4 * one)
    store.put(record("system"))
    for i in range(50):
        assert store.get("system") is not None  # every request hits the system prompt
        store.put(record(f"oneoff{i}"))
    assert store.contains("system")


def test_stale_popular_chunk_eventually_ages_out():
    one = record("x").nbytes
    store = MemoryStore(budget_bytes=3 * one)
    store.put(record("old"))
    for _ in range(5):
        store.get("old")
    for i in range(40):  # a new hot pair takes over
        store.put(record(f"new{i % 2}"))
        store.get(f"new{i % 2}")
        store.put(record(f"tmp{i}"))
    assert not store.contains("old")


def test_chain_tails_go_before_heads():
    one = record("x").nbytes
    store = MemoryStore(budget_bytes=3 * one)
    store.put(record("head", None, start=0))
    store.put(record("tail", "head", start=8))
    store.get("head"), store.get("tail")
    store.put(record("other", None, start=0, tokens=range(100, 108)))
    store.put(record("more", None, start=0, tokens=range(200, 208)))
    assert store.contains("head")


def test_children_and_content_index():
    store = MemoryStore(budget_bytes=10**6)
    store.put(record("a"))
    store.put(record("b", "a", start=8))
    store.put(record("c", "a", start=8, n=3))
    assert {m.key for m in store.children("a")} == {"b", "c"}
    assert [m.key for m in store.by_content("cb")] == ["b"]
    store.delete("b")
    assert {m.key for m in store.children("a")} == {"c"}
    store.clear()
    assert store.stats().entries == 0 and store.stats().bytes == 0


def test_hits_and_misses_counted():
    store = MemoryStore(budget_bytes=10**6)
    store.put(record("a"))
    store.get("a"), store.get("zz")
    s = store.stats()
    assert (s.hits, s.misses) == (1, 1)


def test_oversized_record_refused():
    store = MemoryStore(budget_bytes=10)
    assert store.put(record("a")) is False and store.stats().entries == 0


def _span_records(n_chunks: int, n: int = 8):
    """Records of one write-back: views of one Span per layer."""
    from kvboost.store.base import Span

    keys = [torch.randn(2, n * n_chunks, 4) for _ in range(2)]
    span = Span(0, keys, [k + 1 for k in keys])
    return span, [ChunkRecord(f"s{i}", f"s{i - 1}" if i else None, f"cs{i}", tuple(range(i * n, i * n + n)), i * n,
                              [k[:, i * n:i * n + n] for k in span.keys], [v[:, i * n:i * n + n] for v in span.values],
                              span=span) for i in range(n_chunks)]


def test_evicting_one_record_of_a_span_gives_the_others_memory_of_their_own():
    span, records = _span_records(4)
    store = MemoryStore(budget_bytes=4 * records[0].nbytes)
    for r in records:
        store.put(r)
    before = {r.key: (r.keys[0].clone(), r.values[1].clone()) for r in records}
    store.delete("s3")
    for r in records[:3]:
        kept = store.get(r.key)
        assert kept.span is None
        assert kept.keys[0].untyped_storage().data_ptr() != span.keys[0].untyped_storage().data_ptr()
        assert torch.equal(kept.keys[0], before[r.key][0]) and torch.equal(kept.values[1], before[r.key][1])
    assert store.stats().bytes == 3 * records[0].nbytes  # what the budget counts is what is held


def test_a_span_survives_while_all_its_records_do_and_clear_copies_nothing(monkeypatch):
    span, records = _span_records(3)
    store = MemoryStore(budget_bytes=1 << 20)
    for r in records:
        store.put(r)
    assert all(store.get(r.key) is r for r in records)  # stored as the views they are
    monkeypatch.setattr(ChunkRecord, "standalone", lambda self: pytest.fail("clear() copied a record"))
    store.clear()
    assert store.stats().entries == 0
