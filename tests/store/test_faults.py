"""Tiers that degrade honestly: a refusing Redis, a damaged index, a read-only directory, a slow tier.

Each fault is produced for real (a redis-server at maxmemory or turned into a replica, bytes overwritten
in index.sqlite3, a read-only bind mount) and each test checks what the tier does about it: keeps
serving what it can, counts the event with its reason, logs it once, and never makes a request wait.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from _synth import free_port, make_record, same

from kvboost.config import EngineConfig
from kvboost.store.disk import DiskStore
from kvboost.store.memory import MemoryStore
from kvboost.store.redis import CircuitBreaker, RedisStore
from kvboost.store.tiered import TieredStore, build_store

HERE = Path(__file__).resolve().parent


def _redis(server, **kw) -> RedisStore:
    kw.setdefault("breaker", CircuitBreaker(failure_threshold=1, base_backoff_s=5.0, max_backoff_s=5.0))
    return RedisStore(server.url, "m", **kw)


def _warnings(caplog, text: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno == logging.WARNING and r.name.startswith("kvboost.store")
            and text in r.getMessage()]


def _big(i: int):
    return make_record(i, tokens=64, head_dim=64)  # ~260 KB: a handful fill a 2 MB Redis


# ---- Redis that refuses writes ----------------------------------------------------------------------
@pytest.mark.redis
def test_full_redis_trips_the_write_breaker_and_still_serves_reads(redis_server_factory, caplog):
    server = redis_server_factory("--maxmemory", "2mb", "--maxmemory-policy", "noeviction")
    store = _redis(server)
    first = _big(0)
    assert store.put(first)
    refused_at = next(i for i in range(1, 30) if not store.put(_big(i)))  # OOM: command not allowed...
    t0 = time.monotonic()
    for i in range(refused_at + 1, refused_at + 21):
        assert store.put(_big(i)) is False  # skipped by the open write breaker: nothing is sent
    assert time.monotonic() - t0 < 2.0  # (each used to cost a refused round trip of the whole blob)
    s = store.stats()
    assert s.extra["write_breaker"] == "open" and s.extra["write_breaker_opened"] == 1
    assert s.extra["events"]["write_refused"] == 1 and s.extra["dropped_writes"] == {"refused": 1, "breaker_open": 20}
    assert s.extra["breaker"] == "closed" and same(store.get(first.key), first)  # a full Redis still has hits
    assert len(_warnings(caplog, "write_refused")) == 1 and len(_warnings(caplog, "breaker_open")) == 1


@pytest.mark.redis
def test_refused_write_is_answered_fast(redis_server_factory):
    """redis-py decoded the whole blob into the error message of a refused pipeline (~1.6 s for 6 MB)."""
    server = redis_server_factory("--maxmemory-policy", "noeviction")
    server.client().config_set("maxmemory", "1")  # full from the start
    store = _redis(server)
    big = make_record(0, layers=30, heads=3, tokens=128, head_dim=64, dtype=torch.float16)  # SmolLM2-sized
    t0 = time.monotonic()
    assert store.put(big) is False
    assert time.monotonic() - t0 < 0.5
    assert store.stats().extra["rejected_writes"] == 1


@pytest.mark.redis
def test_read_only_replica_refuses_writes_but_serves_reads(redis_server_factory, caplog):
    server = redis_server_factory()
    store = _redis(server, ttl_s=60)  # reads refresh TTLs with GETEX/EXPIRE, which a replica refuses
    recs = [make_record(i, parent_key="p") for i in range(3)]
    assert all(store.put(r) for r in recs)
    server.client().execute_command("REPLICAOF", "127.0.0.1", str(free_port()))  # a master that never answers
    assert store.put(make_record(9)) is False  # READONLY You can't write against a read only replica
    assert all(same(store.get(r.key), r) for r in recs)  # served without the TTL refresh
    assert {m.key for m in store.children("p")} == {r.key for r in recs}
    s = store.stats()
    assert s.extra["write_breaker"] == "open" and s.extra["breaker"] == "closed"
    assert s.extra["events"]["write_refused"] == 1 and s.extra["events"]["read_only_replica"] == 1
    assert s.hits == 3 and len(_warnings(caplog, "write_refused")) == 1


@pytest.mark.redis
def test_refusing_redis_costs_a_request_nothing(redis_server_factory):
    server = redis_server_factory("--maxmemory-policy", "noeviction")
    server.client().config_set("maxmemory", "1")
    store = TieredStore(MemoryStore(10**9), redis=_redis(server, socket_timeout=0.25))
    recs = [_big(i) for i in range(20)]
    t0 = time.monotonic()
    assert all(store.put(r) for r in recs)  # memory now, Redis behind
    assert time.monotonic() - t0 < 20 * 0.25 / 2  # generous: far below one timeout per write
    assert all(same(store.get(r.key), r) for r in recs)
    assert store.flush(10)
    redis = store.tier_stats()["redis"].extra
    assert redis["dropped_writes"]["refused"] == 1 and redis["dropped_writes"]["breaker_open"] == 19
    assert redis["queued_writes"] == 0 and redis["failed_behind"] == 20


@pytest.mark.redis
def test_hung_redis_costs_requests_one_timeout_in_all(redis_server):
    breaker = CircuitBreaker(failure_threshold=1, base_backoff_s=0.1, max_backoff_s=0.1)
    store = RedisStore(redis_server.url, "m", socket_timeout=0.25, breaker=breaker)
    assert store.put(make_record(0))
    redis_server.pause()
    try:
        t0 = time.monotonic()
        assert store.get("chunk-0") is None
        assert time.monotonic() - t0 < 0.8  # the call that finds it hung pays one timeout...
        slow_calls = 0
        for _ in range(8):
            time.sleep(0.15)  # ...past each backoff the breaker probes again, from a background thread
            t0 = time.monotonic()
            assert store.get("chunk-0") is None and store.children(None) == []
            slow_calls += time.monotonic() - t0 > 0.1
        assert slow_calls == 0 and store.stats().errors >= 2  # the probes did time out, off the request path
    finally:
        redis_server.resume()
    deadline = time.monotonic() + 5
    while store.get("chunk-0") is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert same(store.get("chunk-0"), make_record(0))


# ---- damaged index --------------------------------------------------------------------------------
def _damage_index(directory: Path, how: str) -> None:
    for suffix in ("-wal", "-shm"):
        (directory / f"index.sqlite3{suffix}").unlink(missing_ok=True)
    path = directory / "index.sqlite3"
    data = bytearray(path.read_bytes())
    if how == "header":
        data[:100] = os.urandom(100)  # "file is not a database"
    else:  # the cell area of every b-tree page: only PRAGMA quick_check sees it
        for page in range(1, len(data) // 4096):
            data[page * 4096 + 3000:(page + 1) * 4096] = os.urandom(1096)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["header", "pages"])
def test_damaged_index_is_rebuilt_from_the_files_keeping_every_valid_one(tmp_path, how, caplog):
    recs = [make_record(i, parent_key="p" if i else None, content_key=f"c{i % 3}") for i in range(12)]
    with DiskStore(tmp_path, namespace="m") as store:
        assert all(store.put(r) for r in recs)
        bad = store._path("chunk-5")
    with DiskStore(tmp_path, namespace="other-model") as other:  # another namespace shares the directory
        assert other.put(make_record(100))
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one chunk file is damaged too: that one, and only that one, goes
    bad.write_bytes(bytes(data))
    _damage_index(tmp_path, how)
    with DiskStore(tmp_path, namespace="m") as store:
        s = store.stats()
        assert store.disabled is None and s.extra["events"] == {"index_rebuilt": 1}
        assert s.extra["adopted_files"] == 12 and s.extra["swept_orphans"] == 1 and not bad.exists()
        kept = [r for r in recs if r.key != "chunk-5"]
        assert all(same(store.get(r.key), r) for r in kept)
        assert {m.key for m in store.children("p")} == {r.key for r in kept[1:]}  # the index is whole again
        assert {m.key for m in store.by_content("c1")} == {"chunk-1", "chunk-4", "chunk-7", "chunk-10"}
    with DiskStore(tmp_path, namespace="other-model") as other:
        assert same(other.get("chunk-100"), make_record(100))
    assert len(_warnings(caplog, "index_rebuilt")) == 1


def test_unindexed_valid_file_is_adopted_not_deleted(tmp_path):
    """A writer killed between rename and commit leaves a complete file with no row: it is kept."""
    with DiskStore(tmp_path, namespace="m") as store:
        assert store.put(make_record(0))
    with DiskStore(tmp_path, namespace="m") as store:
        with store._write_txn() as conn:
            conn.execute("DELETE FROM chunks")
    with DiskStore(tmp_path, namespace="m") as store:
        assert same(store.get("chunk-0"), make_record(0)) and store.stats().extra["adopted_files"] == 1


# ---- read-only directory --------------------------------------------------------------------------
def _fill(directory: Path, n: int = 5) -> list:
    recs = [make_record(i, parent_key="p") for i in range(n)]
    with DiskStore(directory, namespace="m") as store:
        assert all(store.put(r) for r in recs)
    return recs


def _listing(directory: Path) -> list[tuple[str, int]]:
    # (SQLite itself may add -wal/-shm next to an index a reader opens when the directory is writable:
    # the emulated read-only case; a real read-only mount gets none)
    return sorted((p.name, p.stat().st_size) for p in directory.rglob("*")
                  if p.is_file() and not p.name.endswith(("-wal", "-shm")))


def test_read_only_directory_serves_hits_and_skips_writes(read_only_view, caplog):
    view = read_only_view()
    recs = _fill(view.source)
    before = _listing(view.source)
    view.make_read_only()
    store = DiskStore(view.path, namespace="m")
    assert store.disabled is None and store.read_only
    assert all(same(store.get(r.key), r) for r in recs)
    assert {m.key for m in store.children("p")} == {r.key for r in recs}
    assert store.put(make_record(50)) is False
    store.delete("chunk-0")
    assert store.contains("chunk-0")  # a delete is a write too: skipped
    s = store.stats()
    assert s.hits == 5 and s.extra["events"]["read_only"] == 1 and s.extra["dropped_writes"] == {"read_only": 2}
    store.close()
    assert _listing(view.source) == before
    assert len(_warnings(caplog, "serving hits, skipping writes")) == 1
    assert len(_warnings(caplog, "writes dropped (read_only)")) == 1


def test_read_only_directory_with_a_damaged_index_indexes_the_files_in_memory(read_only_view):
    view = read_only_view()
    recs = _fill(view.source)
    _damage_index(view.source, "header")
    view.make_read_only()
    with DiskStore(view.path, namespace="m") as store:
        assert store.read_only and all(same(store.get(r.key), r) for r in recs)
        assert store.stats().entries == 5 and store.stats().extra["events"] == {"read_only": 1}
    assert len(list(view.source.glob("chunks/*/*.kvb"))) == 5  # nothing deleted, nothing rewritten


def test_read_only_mount_while_a_writer_is_live(read_only_view):
    view = read_only_view()
    writer = DiskStore(view.source, namespace="m")
    recs = [make_record(i) for i in range(3)]
    assert all(writer.put(r) for r in recs)
    view.make_read_only()
    with DiskStore(view.path, namespace="m") as reader:
        assert reader.read_only and all(same(reader.get(r.key), r) for r in recs)
    writer.close()


def test_directory_that_turns_read_only_keeps_serving(read_only_view, caplog):
    view = read_only_view()
    if view.emulated:
        pytest.skip("needs a real read-only remount (mount privileges)")
    store = DiskStore(view.path, namespace="m")
    assert store.put(make_record(0)) and not store.read_only
    view.make_read_only(sub=str(store._path("x").parent.relative_to(view.path)))  # where chunk files go
    assert store.put(make_record(1)) is False and store.put(make_record(2)) is False
    assert store.read_only and "Read-only file system" in store.read_only
    assert same(store.get("chunk-0"), make_record(0))
    s = store.stats()
    assert s.extra["dropped_writes"] == {"read_only": 2} and s.extra["events"]["read_only"] == 1
    assert len(_warnings(caplog, "became read-only")) == 1
    store.close()


# ---- write-behind ---------------------------------------------------------------------------------
class GatedTier:
    """A tier whose writes wait at a gate, so a test can hold the write-behind thread mid-write."""

    def __init__(self, inner):
        self.inner, self.name = inner, inner.name
        self.gate, self.entered = threading.Event(), threading.Event()

    def put(self, record):
        self.entered.set()
        assert self.gate.wait(10)
        return self.inner.put(record)

    def __getattr__(self, attr):
        return getattr(self.inner, attr)


def _gated_store(tmp_path, memory_bytes=10**9, **kw) -> tuple[TieredStore, GatedTier]:
    disk = GatedTier(DiskStore(tmp_path, namespace="m"))
    return TieredStore(MemoryStore(memory_bytes), disk=disk, write_through_disk=True, **kw), disk


def test_put_never_waits_for_a_slow_tier(tmp_path):
    store, disk = _gated_store(tmp_path)
    recs = [make_record(i) for i in range(4)]
    assert all(store.put(r) for r in recs)  # returns while the disk write is held at the gate
    assert disk.entered.wait(5) and not store.flush(0.05)
    assert store.tier_stats()["disk"].extra["queued_writes"] >= 3
    disk.gate.set()
    assert store.flush(10) and all(disk.inner.contains(r.key) for r in recs)
    assert store.tier_stats()["disk"].extra["written_behind"] == 4


def test_a_queued_chunk_is_served_from_the_queue(tmp_path):
    store, disk = _gated_store(tmp_path, memory_bytes=10)  # memory holds nothing: only the queue has them
    root, kid = make_record(0), make_record(1, parent_key="chunk-0", content_key="c")
    assert store.put(root) and store.put(kid)
    assert disk.entered.wait(5)  # root is being written, kid waits behind it
    assert same(store.get("chunk-0"), root) and same(store.get("chunk-1"), kid)
    assert store.contains("chunk-1") and [m.key for m in store.children("chunk-0")] == ["chunk-1"]
    assert [m.key for m in store.by_content("c")] == ["chunk-1"]
    assert store.tier_stats()["memory"].extra["queue_hits"] == 2
    disk.gate.set()
    assert store.flush(10) and same(store.get("chunk-1"), kid)  # now from disk


def test_full_queue_drops_writes_and_counts_them(tmp_path, caplog):
    rec_bytes = make_record(0).nbytes
    store, disk = _gated_store(tmp_path, write_queue_bytes=2 * rec_bytes)
    assert store.put(make_record(0)) and disk.entered.wait(5)  # in flight: no longer counts against the bound
    results = [store.put(make_record(i)) for i in range(1, 6)]
    assert results == [True] * 5  # memory holds them all; only two could be queued for disk
    dropped = store.tier_stats()["disk"].extra["dropped_writes"]
    assert dropped == {"queue_full": 3}
    disk.gate.set()
    assert store.flush(10) and sorted(disk.inner.keys()) == ["chunk-0", "chunk-1", "chunk-2"]
    assert len(_warnings(caplog, "queue_full")) == 1


def test_delete_queued_after_a_put_wins(tmp_path):
    store, disk = _gated_store(tmp_path, memory_bytes=10)
    assert store.put(make_record(0, parent_key="p")) and store.put(make_record(1, parent_key="p"))
    assert disk.entered.wait(5)
    store.delete("chunk-1")
    assert store.get("chunk-1") is None and not store.contains("chunk-1")
    assert [m.key for m in store.children("p")] == ["chunk-0"]
    disk.gate.set()
    assert store.flush(10) and disk.inner.keys() == ["chunk-0"]


def test_close_flushes_so_a_restart_gets_hits(tmp_path):
    store = TieredStore(MemoryStore(10**9), disk=DiskStore(tmp_path, namespace="m"), write_through_disk=True)
    recs = [make_record(i) for i in range(5)]
    assert all(store.put(r) for r in recs)
    assert store.close(10)
    assert store.put(make_record(9))  # memory still works after close; the disk write is dropped, counted
    assert store.tier_stats()["disk"].extra["dropped_writes"]["closed"] == 1
    with DiskStore(tmp_path, namespace="m") as again:
        assert all(same(again.get(r.key), r) for r in recs)


def test_a_process_that_exits_without_close_still_leaves_its_chunks(tmp_path):
    script = f"""
import sys, time
sys.path.insert(0, {str(HERE)!r})
from _synth import make_record
from kvboost.store.disk import DiskStore
from kvboost.store.memory import MemoryStore
from kvboost.store.tiered import TieredStore

class SlowDisk(DiskStore):
    def put(self, record):
        time.sleep(0.05)
        return super().put(record)

store = TieredStore(MemoryStore(10**9), disk=SlowDisk({str(tmp_path)!r}, namespace="m"), write_through_disk=True)
for i in range(8):
    store.put(make_record(i))
print(store.tier_stats()["disk"].extra["queued_writes"])
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    assert int(out.stdout.split()[-1]) > 0  # it exited with writes still queued...
    with DiskStore(tmp_path, namespace="m") as store:  # ...and the exit hook flushed them
        assert sorted(store.keys()) == sorted(f"chunk-{i}" for i in range(8))


def test_a_store_built_on_the_same_directory_sees_what_this_process_queued(tmp_path):
    cfg = EngineConfig(memory_budget_bytes=10**8, disk_cache_dir=str(tmp_path), disk_budget_bytes=10**9)
    first = build_store(cfg, namespace="m")
    recs = [make_record(i) for i in range(6)]
    assert all(first.put(r) for r in recs)
    second = build_store(cfg, namespace="m")  # no flush by the caller
    assert all(second.disk.contains(r.key) for r in recs)
    first.close()
    second.close()
