"""Redis tier against a real redis-server: format, indexes, TTL, maxmemory, and a server that dies or hangs."""
from __future__ import annotations

import time

import pytest
import torch
from _synth import free_port, layered_blob, make_record, same

from kvboost.store.redis import CircuitBreaker, RedisStore

pytestmark = pytest.mark.redis
pytest.importorskip("redis", reason="redis-py not installed (pip install 'kvboost[redis]')")


def _store(server, namespace="m", **kw) -> RedisStore:
    kw.setdefault("breaker", CircuitBreaker(failure_threshold=1, base_backoff_s=0.2, max_backoff_s=1.0))
    return RedisStore(server.url, namespace, **kw)


def test_round_trip_and_indexes(redis_server):
    store = _store(redis_server)
    root = make_record(0)
    kids = [make_record(i, parent_key=root.key, content_key="shared", start=16) for i in (1, 2)]
    assert all(store.put(r) for r in [root, *kids])
    assert same(store.get(root.key), root)
    assert store.contains(kids[1].key) and not store.contains("nope")
    assert [m.key for m in store.children(None)] == [root.key]
    assert {m for m in store.children(root.key)} == {k.meta() for k in kids}
    assert {m.key for m in store.by_content("shared")} == {k.key for k in kids}
    assert store.get("nope") is None
    assert redis_server.client().exists(f"kvboost:m:chunk:{root.key}")
    store.delete(kids[0].key)
    assert [m.key for m in store.children(root.key)] == [kids[1].key]
    s = store.stats()
    assert (s.hits, s.misses, s.errors) == (1, 1, 0)
    store.clear()
    assert redis_server.client().keys("kvboost:m:*") == []


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_blobs(redis_server, bits):
    store = _store(redis_server, bits=bits)
    rec = make_record(1, tokens=128, head_dim=64, dtype=torch.bfloat16)
    assert store.put(rec)
    blob = redis_server.client().get(f"kvboost:m:chunk:{rec.key}")
    assert len(blob) < rec.nbytes * (0.55 if bits == 8 else 0.31)
    out = store.get(rec.key)
    assert out.meta() == rec.meta() and out.keys[0].dtype == torch.bfloat16


def test_namespace_isolation(redis_server):
    a, b = _store(redis_server, "model-a"), _store(redis_server, "model-b")
    rec = make_record(0)
    assert a.put(rec)
    assert b.get(rec.key) is None and b.children(None) == [] and not b.contains(rec.key)
    # A blob copied under B's key still names namespace A: refused and removed.
    client = redis_server.client()
    client.set(f"kvboost:model-b:chunk:{rec.key}", client.get(f"kvboost:model-a:chunk:{rec.key}"))
    assert b.get(rec.key) is None and b.stats().extra["corrupt_dropped"] == 1
    assert same(a.get(rec.key), rec)
    b.clear()
    assert a.contains(rec.key)


def test_format_1_blobs_are_read_and_newer_formats_left_alone(redis_server):
    store = _store(redis_server)
    old, newer = make_record(30), make_record(31)
    assert store.put(old) and store.put(newer)
    client = redis_server.client()
    client.set(f"kvboost:m:chunk:{old.key}", layered_blob(old, "m"))  # as kvboost before 0.2.0 wrote it
    client.set(f"kvboost:m:chunk:{newer.key}", layered_blob(newer, "m", version=3))
    assert same(store.get(old.key), old)
    assert store.get(newer.key) is None
    s = store.stats()
    assert s.extra["events"]["unsupported_format"] == 1 and s.extra["corrupt_dropped"] == 0
    assert client.exists(f"kvboost:m:chunk:{newer.key}")  # not ours to delete


def test_corrupt_blob_is_dropped(redis_server):
    store = _store(redis_server)
    rec = make_record(0)
    assert store.put(rec)
    client = redis_server.client()
    blob = bytearray(client.get(f"kvboost:m:chunk:{rec.key}"))
    blob[len(blob) // 2] ^= 0xFF
    client.set(f"kvboost:m:chunk:{rec.key}", bytes(blob))
    assert store.get(rec.key) is None
    assert store.stats().extra["corrupt_dropped"] == 1
    assert not client.exists(f"kvboost:m:chunk:{rec.key}") and store.children(None) == []


def test_ttl_expires_entries(redis_server):
    store = _store(redis_server, ttl_s=1)
    rec = make_record(0)
    assert store.put(rec)
    ttl = redis_server.client().ttl(f"kvboost:m:chunk:{rec.key}")
    assert 0 < ttl <= 1
    assert store.get(rec.key) is not None
    time.sleep(1.2)
    assert store.get(rec.key) is None and store.children(None) == []


def test_maxmemory_eviction_is_a_clean_miss(redis_server_factory):
    server = redis_server_factory("--maxmemory", "2mb", "--maxmemory-policy", "allkeys-lru")
    store = _store(server)
    recs = [make_record(i, parent_key="p", tokens=64, head_dim=64) for i in range(40)]  # ~260 KB each
    assert all(store.put(r) for r in recs)
    served = [r.key for r in recs if store.get(r.key) is not None]
    assert 0 < len(served) < len(recs)
    listed = {m.key for m in store.children("p")}
    client = server.client()
    assert all(client.exists(f"kvboost:m:chunk:{k}") for k in listed)  # no index entry without its blob
    s = store.stats()
    assert s.errors == 0 and s.misses == len(recs) - len(served)


def test_index_entry_without_blob_is_cleaned(redis_server):
    store = _store(redis_server)
    recs = [make_record(i, parent_key="p", content_key="c") for i in range(3)]
    assert all(store.put(r) for r in recs)
    client = redis_server.client()
    client.delete("kvboost:m:chunk:chunk-0", "kvboost:m:chunk:chunk-1")  # what maxmemory eviction does
    assert store.get("chunk-0") is None  # a miss, and its meta + index memberships go with it
    assert [m.key for m in store.children("p")] == ["chunk-2"]  # chunk-1 found stale here and removed
    assert [m.key for m in store.by_content("c")] == ["chunk-2"]
    assert client.smembers('kvboost:m:children:"p"') == {b"chunk-2"}
    assert client.smembers("kvboost:m:content:c") == {b"chunk-2"}
    assert not client.exists("kvboost:m:meta:chunk-0", "kvboost:m:meta:chunk-1")
    assert store.stats().extra["stale_index_cleaned"] == 2


def test_full_server_without_eviction_rejects_writes_only(redis_server_factory):
    server = redis_server_factory("--maxmemory", "2mb", "--maxmemory-policy", "noeviction")
    store = _store(server)
    first = make_record(0, tokens=64, head_dim=64)
    assert store.put(first)
    results = [store.put(make_record(i, tokens=64, head_dim=64)) for i in range(1, 20)]
    assert not all(results)
    s = store.stats()
    assert s.errors >= 1 and s.extra["rejected_writes"] >= 1 and s.extra["breaker"] == "closed"
    assert s.extra["write_breaker_opened"] >= 1  # refused writes are skipped like an unreachable server's
    assert same(store.get(first.key), first)  # reads still work on a full server


def test_server_down_then_back(redis_server):
    store = _store(redis_server)
    assert store.put(make_record(0))
    redis_server.stop()
    t0 = time.monotonic()
    for i in range(100):
        assert store.get(f"chunk-{i % 3}") is None
        assert store.put(make_record(i)) is False
        assert store.children(None) == [] and not store.contains("chunk-0")
    assert time.monotonic() - t0 < 2.0  # the breaker skips the dead server instead of timing out each call
    s = store.stats()
    assert s.errors >= 1 and s.extra["short_circuited"] > 100 and s.extra["breaker_opened"] >= 1
    redis_server.start()  # same port, empty (no persistence)
    deadline = time.monotonic() + 5
    while not store.put(make_record(7)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert same(store.get("chunk-7"), make_record(7))
    assert store.stats().extra["breaker"] == "closed"


def test_hung_server_costs_one_timeout(redis_server):
    store = _store(redis_server, socket_timeout=0.25)
    assert store.put(make_record(0))
    redis_server.pause()
    try:
        t0 = time.monotonic()
        assert store.get("chunk-0") is None
        assert time.monotonic() - t0 < 0.8
        t1 = time.monotonic()
        for _ in range(50):
            assert store.get("chunk-0") is None
        assert time.monotonic() - t1 < 0.5  # breaker open: no more timeouts
    finally:
        redis_server.resume()
    deadline = time.monotonic() + 5
    while store.get("chunk-0") is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert same(store.get("chunk-0"), make_record(0))


def test_unreachable_at_start_never_raises(tmp_path):
    store = RedisStore(f"redis://127.0.0.1:{free_port()}/0", "m", breaker=CircuitBreaker(failure_threshold=1))
    assert store.get("x") is None and store.put(make_record(0)) is False
    assert store.children(None) == [] and store.by_content("c") == [] and not store.contains("x")
    store.delete("x")
    store.clear()
    assert store.stats().errors >= 1


def test_breaker_backoff_doubles_and_resets():
    b = CircuitBreaker(failure_threshold=2, base_backoff_s=0.05, max_backoff_s=0.15)
    b.failure()
    assert b.allow() and b.state == "closed"
    b.failure()
    assert not b.allow() and b.state == "open"
    time.sleep(0.06)
    assert b.allow()  # one probe...
    assert not b.allow()  # ...at a time
    b.failure()  # probe failed: 0.1 s
    time.sleep(0.06)
    assert not b.allow()
    time.sleep(0.05)
    assert b.allow()
    b.success()
    assert b.state == "closed" and b.allow()
