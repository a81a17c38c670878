"""Tiered store: lookup order, promotion, spill to disk, write-through to Redis, merged indexes, build_store."""
from __future__ import annotations

import pytest
import torch
from _synth import make_record, same

from kvboost.config import EngineConfig
from kvboost.store.base import ChunkStore, TierStats
from kvboost.store.disk import DiskStore
from kvboost.store.memory import MemoryStore
from kvboost.store.quant import QuantCodec
from kvboost.store.redis import CircuitBreaker, RedisStore
from kvboost.store.tiered import TieredStore, build_store


def test_memory_only(record_factory):
    store = TieredStore(MemoryStore(10**8))
    assert isinstance(store, ChunkStore)
    rec = record_factory(0)
    assert store.put(rec) and same(store.get(rec.key), rec)
    assert store.get("nope") is None
    s = store.stats()
    assert isinstance(s, TierStats) and (s.hits, s.misses, s.entries) == (1, 1, 1)
    assert set(s.extra["tiers"]) == {"memory"}


def test_memory_evictions_spill_to_disk_and_promote_back(tmp_path):
    recs = [make_record(i, parent_key="p" if i else None) for i in range(8)]
    memory = MemoryStore(3 * recs[0].nbytes)
    store = TieredStore(memory, disk=DiskStore(tmp_path, namespace="m"))
    assert all(store.put(r) for r in recs)
    assert store.flush(10)  # spills are written behind
    tiers = store.tier_stats()
    assert tiers["memory"].entries == 3 and tiers["disk"].entries == 5  # nothing lost, overflow on disk
    assert all(same(store.get(r.key), r) for r in recs)
    tiers = store.tier_stats()
    assert tiers["disk"].promotions >= 5 and tiers["disk"].hits >= 5
    assert store.stats().hits == 8 and store.stats().promotions == tiers["disk"].promotions
    assert {m.key for m in store.children("p")} == {r.key for r in recs[1:]}  # merged across tiers, no dupes
    assert len(store.children("p")) == 7
    assert [m.key for m in store.by_content("content-3")] == ["chunk-3"]
    store.delete("chunk-3")
    assert store.get("chunk-3") is None and not store.contains("chunk-3")


def test_record_larger_than_memory_goes_to_disk(tmp_path):
    rec = make_record(0, tokens=128)
    store = TieredStore(MemoryStore(rec.nbytes // 2), disk=DiskStore(tmp_path, namespace="m"))
    assert store.put(rec) and same(store.get(rec.key), rec)


def test_quantized_memory_with_disk(tmp_path):
    memory = MemoryStore(2 * 30_000, codec=QuantCodec(8))
    store = TieredStore(memory, disk=DiskStore(tmp_path, namespace="m", bits=8))
    recs = [make_record(i, tokens=128, head_dim=64, dtype=torch.float16) for i in range(6)]
    assert all(store.put(r) for r in recs)
    for r in recs:
        got = store.get(r.key)
        assert got.meta() == r.meta() and got.keys[0].dtype == torch.float16
        assert (got.keys[0].float() - r.keys[0].float()).abs().max() < 0.05


def test_disk_survives_restart_through_tiered(tmp_path):
    first = TieredStore(MemoryStore(make_record(0).nbytes), disk=DiskStore(tmp_path, namespace="m"))
    for i in range(4):
        first.put(make_record(i))
    first.close()
    second = TieredStore(MemoryStore(10**8), disk=DiskStore(tmp_path, namespace="m"))
    assert same(second.get("chunk-0"), make_record(0))  # it was spilled by the first process
    other = TieredStore(MemoryStore(10**8), disk=DiskStore(tmp_path, namespace="another-model"))
    assert other.get("chunk-0") is None


def test_disk_write_through_is_visible_to_other_processes_and_restarts(tmp_path):
    writer = TieredStore(MemoryStore(10**8), disk=DiskStore(tmp_path, namespace="m"), write_through_disk=True)
    recs = [make_record(i) for i in range(3)]
    assert all(writer.put(r) for r in recs)
    assert writer.flush(10)
    assert writer.tier_stats()["memory"].evictions == 0  # nothing had to be evicted to reach the disk
    reader = TieredStore(MemoryStore(10**8), disk=DiskStore(tmp_path, namespace="m"))
    assert all(same(reader.get(r.key), r) for r in recs)
    assert {m.key for m in reader.children(None)} == {r.key for r in recs}


@pytest.mark.redis
def test_redis_write_through_and_promotion(redis_server):
    breaker = CircuitBreaker(failure_threshold=1, base_backoff_s=0.2)
    a = TieredStore(MemoryStore(10**8), redis=RedisStore(redis_server.url, "m", breaker=breaker))
    rec = make_record(0, parent_key="p")
    assert a.put(rec) and a.flush(10)
    b = TieredStore(MemoryStore(10**8), redis=RedisStore(redis_server.url, "m"))  # another host, same Redis
    assert [m.key for m in b.children("p")] == [rec.key]
    assert same(b.get(rec.key), rec)
    assert b.tier_stats()["redis"].promotions == 1 and b.memory.contains(rec.key)
    redis_server.stop()  # a dead Redis costs nothing on the memory path and raises nowhere
    assert same(a.get(rec.key), rec) and a.get("missing") is None
    assert a.put(make_record(1)) and a.flush(10) and a.children("p") == [rec.meta()]
    assert a.tier_stats()["redis"].errors >= 1


@pytest.mark.redis
def test_build_store_from_config(tmp_path, redis_server):
    cfg = EngineConfig(kv_cache_bits=4, memory_budget_bytes=10**7, disk_cache_dir=str(tmp_path / "cache"),
                       disk_budget_bytes=10**8, redis_url=redis_server.url, redis_ttl_s=60)
    store = build_store(cfg, namespace="model@rev|salt")
    assert isinstance(store.memory.codec, QuantCodec) and store.memory.codec.bits == 4
    assert isinstance(store.disk, DiskStore) and store.disk.budget_bytes == 10**8
    assert isinstance(store.redis, RedisStore) and store.redis.ttl_s == 60
    rec = make_record(0, tokens=128, head_dim=64)
    assert store.put(rec) and store.get(rec.key).meta() == rec.meta()
    assert store.flush(10)
    assert set(store.stats().extra["tiers"]) == {"memory", "disk", "redis"}
    assert store.disk.contains(rec.key) and store.redis.contains(rec.key)  # written through to both


def test_build_store_defaults(tmp_path):
    plain = build_store(EngineConfig(memory_budget_bytes=10**6), namespace="x")
    assert plain.memory.codec is None and plain.disk is None and plain.redis is None
    auto = build_store(EngineConfig(memory_budget_bytes=10**6, disk_cache_dir=str(tmp_path / "auto")), namespace="x")
    assert 0 < auto.disk.budget_bytes <= 16 * 1024**3  # no unbounded disk cache by default


def test_watch_reports_what_the_fast_tiers_hold_with_their_medium():
    from kvboost.store.host import HostStore

    one = make_record(0).nbytes
    store = TieredStore(MemoryStore(2 * one), host=HostStore(2 * one))
    seen: list[tuple[str, str | None, str]] = []
    store.watch(lambda kind, meta, medium: seen.append((kind, meta.key if meta else None, medium)), "GPU")
    for i in range(3):  # the third pushes the coldest out of the device tier into the host tier
        store.put(make_record(i))
    assert seen[:2] == [("stored", "chunk-0", "GPU"), ("stored", "chunk-1", "GPU")]
    assert sorted(seen[2:]) == sorted([("removed", seen[2][1], "GPU"), ("stored", seen[2][1], "CPU"),
                                       ("stored", "chunk-2", "GPU")])
    held = {key: medium for kind, key, medium in seen if kind == "stored"}
    for kind, key, medium in seen:
        if kind == "removed" and held.get(key) == medium:
            del held[key]
    assert all(store.contains(key) for key in held) and len(held) == 3  # the events replay to what is held
    seen.clear()
    store.delete("chunk-2")
    assert seen == [("removed", "chunk-2", "GPU")]
    seen.clear()
    store.clear()
    assert seen == [("cleared", None, "GPU"), ("cleared", None, "CPU")]
    store.watch(None, "GPU")
    store.put(make_record(5))
    assert seen == [("cleared", None, "GPU"), ("cleared", None, "CPU")]  # no listener: nothing told
