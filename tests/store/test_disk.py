"""Disk tier: persistence, budget, namespace isolation, and damage/crash/concurrency fault injection."""
from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from _synth import layered_blob, make_record, same

from kvboost.store.disk import DiskStore

WRITER = str(Path(__file__).resolve().parent / "_synth.py")


def _chunk_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("chunks/*/*.kvb"))


def _tmp_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("chunks/*/.*.tmp"))


def test_round_trip_meta_and_indexes(tmp_path):
    store = DiskStore(tmp_path, namespace="m")
    root = make_record(0)
    kids = [make_record(i, parent_key=root.key, content_key="shared", start=16) for i in (1, 2)]
    for rec in [root, *kids]:
        assert store.put(rec)
    assert same(store.get(root.key), root)
    assert store.contains(kids[0].key) and not store.contains("nope")
    assert [m.key for m in store.children(None)] == [root.key]
    assert sorted(m.key for m in store.children(root.key)) == sorted(k.key for k in kids)
    assert {m for m in store.by_content("shared")} == {k.meta() for k in kids}
    assert store.get("nope") is None
    s = store.stats()
    assert (s.entries, s.hits, s.misses, s.errors) == (3, 1, 1, 0)
    store.delete(root.key)
    assert store.get(root.key) is None and len(_chunk_files(tmp_path)) == 2
    store.clear()
    assert store.stats().entries == 0 and _chunk_files(tmp_path) == []


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_on_disk(tmp_path, bits):
    store = DiskStore(tmp_path, namespace="m", bits=bits)
    rec = make_record(1, tokens=128, head_dim=64, dtype=torch.float16)
    assert store.put(rec)
    out = store.get(rec.key)
    assert out.meta() == rec.meta() and out.keys[0].dtype == torch.float16
    assert (out.values[0].float() - rec.values[0].float()).abs().max() < (0.05 if bits == 8 else 0.8)
    assert store.stats().bytes < rec.nbytes * (0.55 if bits == 8 else 0.31)


def test_reopen_gets_entries_back(tmp_path):
    with DiskStore(tmp_path, namespace="m") as store:
        recs = [make_record(i) for i in range(5)]
        assert all(store.put(r) for r in recs)
    with DiskStore(tmp_path, namespace="m") as again:
        assert all(same(again.get(r.key), r) for r in recs)
        assert again.stats().entries == 5


def test_budget_evicts_least_hit_oldest_first(tmp_path):
    size = len(_blob_size_probe(tmp_path / "probe"))
    store = DiskStore(tmp_path / "d", budget_bytes=5 * size, namespace="m")
    for i in range(5):
        assert store.put(make_record(i))
    for _ in range(3):
        assert store.get("chunk-0") is not None and store.get("chunk-1") is not None
    for i in range(5, 12):
        assert store.put(make_record(i))
        s = store.stats()
        assert s.bytes <= 5 * size and s.extra["directory_bytes"] <= 5 * size
    keys = set(store.keys())
    assert {"chunk-0", "chunk-1", "chunk-11"} <= keys and len(keys) == 5
    assert store.stats().evictions == 7 and len(_chunk_files(tmp_path / "d")) == 5
    assert not store.put(make_record(99, tokens=512))  # larger than the whole budget: refused, nothing evicted
    assert len(store.keys()) == 5


def _blob_size_probe(directory: Path) -> bytes:
    with DiskStore(directory, namespace="m") as probe:
        probe.put(make_record(0))
        return _chunk_files(directory)[0].read_bytes()


def test_namespace_isolation(tmp_path):
    with DiskStore(tmp_path, namespace="model-a|salt-1") as a:
        rec = make_record(0)
        assert a.put(rec)
    b = DiskStore(tmp_path, namespace="model-b|salt-1")
    assert b.get(rec.key) is None and not b.contains(rec.key)
    assert b.children(None) == [] and b.by_content(rec.content_key) == [] and b.stats().entries == 0
    # Even a row forged to point B at A's bytes is refused: the blob names its namespace.
    forged = b._path(rec.key)
    forged.parent.mkdir(parents=True, exist_ok=True)
    forged.write_bytes(_chunk_files(tmp_path)[0].read_bytes())
    with sqlite3.connect(tmp_path / "index.sqlite3") as db:
        db.execute("INSERT INTO chunks SELECT 'model-b|salt-1', key, parent_key, content_key, start, n_tokens, "
                   "token_ids, nbytes, checksum, ?, hits, last_access FROM chunks",
                   (str(forged.relative_to(tmp_path)),))
    assert b.contains(rec.key) and b.get(rec.key) is None
    assert b.stats().extra["corrupt_dropped"] == 1 and not b.contains(rec.key)
    b.close()
    with DiskStore(tmp_path, namespace="model-a|salt-1") as a2:
        assert same(a2.get(rec.key), rec)


def test_foreign_manifest_disables_directory(tmp_path):
    (tmp_path / "manifest.json").write_text('{"format": "something-else", "version": 7}')
    store = DiskStore(tmp_path, namespace="m")
    assert store.disabled and not store.put(make_record(0)) and store.get("chunk-0") is None
    assert store._lock_fd is None  # a disabled store holds no lock on the directory


@pytest.mark.parametrize("damage", ["truncate", "truncate_to_zero", "flip_header", "flip_middle", "flip_last",
                                    "append", "garbage"])
def test_damaged_file_is_dropped_never_served(tmp_path, damage):
    store = DiskStore(tmp_path, namespace="m", bits=8)
    rec = make_record(0, tokens=64, head_dim=32)
    other = make_record(1)
    assert store.put(rec) and store.put(other)
    path = store._path(rec.key)
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "truncate_to_zero":
        data = bytearray()
    elif damage == "append":
        data += b"\0" * 8
    elif damage == "garbage":
        data = bytearray(os.urandom(len(data)))
    else:
        pos = {"flip_header": 30, "flip_middle": len(data) // 2, "flip_last": len(data) - 1}[damage]
        data[pos] ^= 0x01
    path.write_bytes(bytes(data))
    assert store.get(rec.key) is None
    s = store.stats()
    assert s.extra["corrupt_dropped"] == 1 and s.misses == 1 and s.errors == 0
    assert not path.exists() and not store.contains(rec.key)
    assert store.get(other.key).meta() == other.meta()  # (8-bit: lossy, so compare metadata)
    assert store.put(rec) and store.get(rec.key) is not None  # the slot is usable again


def test_file_deleted_behind_our_back_is_a_miss(tmp_path):
    store = DiskStore(tmp_path, namespace="m")
    assert store.put(make_record(0))
    store._path("chunk-0").unlink()
    assert store.get("chunk-0") is None and not store.contains("chunk-0")
    assert store.stats().extra["missing_files"] == 1


def test_corrupt_index_is_rebuilt_from_the_files(tmp_path):
    with DiskStore(tmp_path, namespace="m") as store:
        store.put(make_record(0))
    for suffix in ("-wal", "-shm"):
        (tmp_path / f"index.sqlite3{suffix}").unlink(missing_ok=True)
    (tmp_path / "index.sqlite3").write_bytes(b"this is not a database" * 100)
    with DiskStore(tmp_path, namespace="m") as store:  # (more damage kinds: test_faults.py)
        assert store.disabled is None and same(store.get("chunk-0"), make_record(0))
        assert len(_chunk_files(tmp_path)) == 1 and store.stats().extra["events"]["index_rebuilt"] == 1
        assert store.put(make_record(1)) and store.get("chunk-1") is not None


def test_temp_files_of_dead_writers_are_swept(tmp_path):
    with DiskStore(tmp_path, namespace="m") as store:
        store.put(make_record(0))
        ns_dir = store._path("x").parent
        host = store._host
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_tmp = ns_dir / f".abc.{host}.{int(dead.stdout)}.0000.tmp"
    live_tmp = ns_dir / f".def.{host}.{os.getpid()}.0001.tmp"
    orphan = ns_dir / "0123456789abcdef0123456789abcdef.kvb"
    for p in (dead_tmp, live_tmp, orphan):
        p.write_bytes(b"partial")
    holder = DiskStore(tmp_path, namespace="m")  # first opener: alone, sweeps everything
    assert _tmp_files(tmp_path) == [] and not orphan.exists()
    for p in (dead_tmp, live_tmp, orphan):
        p.write_bytes(b"partial")
    with DiskStore(tmp_path, namespace="m"):  # shares the directory with `holder`: only dead writers' leftovers
        assert not dead_tmp.exists() and live_tmp.exists() and orphan.exists()
    holder.close()
    assert same(DiskStore(tmp_path, namespace="m").get("chunk-0"), make_record(0))


def _spawn_writer(directory: Path, first: int, last: int, budget: int = 0, shape=(8, 4, 128, 64), go=None):
    env = dict(os.environ, KVBOOST_TEST_GO=str(go)) if go else None
    return subprocess.Popen([sys.executable, WRITER, str(directory), "ns", str(first), str(last), str(budget),
                             *map(str, shape)], stdout=subprocess.PIPE, text=True, env=env)


def _verify_everything_served(directory: Path, shape=(8, 4, 128, 64)) -> int:
    """Every indexed entry must be served and bit-identical to what its writer made."""
    with DiskStore(directory, namespace="ns") as store:
        keys = store.keys()
        for key in keys:
            got = store.get(key)
            assert got is not None, key
            assert same(got, make_record(int(key.split("-")[1]), *shape))
        assert store.stats().extra["corrupt_dropped"] == 0
    return len(keys)


@pytest.mark.parametrize("kill_after", [1, 4])
def test_sigkill_mid_write_leaves_usable_cache(tmp_path, kill_after):
    proc = _spawn_writer(tmp_path, 0, 10_000)
    for _ in range(kill_after):
        assert proc.stdout.readline(), "writer died on its own"
    ns_dir = next((tmp_path / "chunks").iterdir())
    deadline = time.monotonic() + 20
    # Kill the moment a temp file appears: inside the write of a 2 MB blob (or just before its rename).
    while not any(e.name.endswith(".tmp") for e in os.scandir(ns_dir)) and time.monotonic() < deadline:
        time.sleep(0.0002)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    partial = _tmp_files(tmp_path)  # almost always one half-written file; its presence is not required
    assert _verify_everything_served(tmp_path) >= kill_after
    assert _tmp_files(tmp_path) == [] and all(not p.exists() for p in partial)
    with DiskStore(tmp_path, namespace="ns") as store:  # and it keeps working
        assert store.put(make_record(50_000)) and store.get("chunk-50000") is not None


@pytest.mark.parametrize("budget_records", [0, 12])
def test_two_processes_share_one_directory(tmp_path, budget_records):
    shape = (4, 2, 64, 32)
    budget = 0
    if budget_records:
        with DiskStore(tmp_path / "probe", namespace="ns") as probe:
            probe.put(make_record(0, *shape))
            budget = budget_records * probe.stats().bytes
    go = tmp_path / "go"
    writers = [_spawn_writer(tmp_path / "d", first, first + 40, budget, shape, go) for first in (0, 20)]
    assert all(w.stdout.readline().strip() == "ready" for w in writers)
    go.touch()
    outputs = [w.communicate(timeout=60)[0] for w in writers]
    assert all(w.returncode == 0 for w in writers)
    assert all(line.endswith(" 1") for out in outputs for line in out.splitlines())  # every put succeeded
    n = _verify_everything_served(tmp_path / "d", shape)
    if budget_records:
        assert n <= budget_records
    else:
        assert n == 60
    assert _tmp_files(tmp_path / "d") == []


def test_get_never_raises_when_directory_vanishes(tmp_path):
    import shutil
    store = DiskStore(tmp_path / "d", namespace="m")
    assert store.put(make_record(0))
    shutil.rmtree(tmp_path / "d")
    assert store.get("chunk-0") is None
    assert store.put(make_record(1)) is False
    assert store.children(None) == [] or True  # may still list rows from the unlinked (open) index
    assert store.stats().errors >= 1


def test_format_1_files_are_read_and_newer_formats_left_alone(tmp_path):
    old, newer = make_record(20), make_record(21)
    with DiskStore(tmp_path, namespace="m") as store:
        assert store.put(old) and store.put(newer)
        store._path(old.key).write_bytes(layered_blob(old, "m"))  # as kvboost before 0.2.0 wrote it
        store._path(newer.key).write_bytes(layered_blob(newer, "m", version=3))  # as a later one might
        assert same(store.get(old.key), old)
        assert store.get(newer.key) is None and not store.contains(newer.key)
        s = store.stats()
        assert s.extra["events"]["unsupported_format"] == 1 and s.extra["corrupt_dropped"] == 0
        assert store._path(newer.key).exists()  # not ours to delete
    for suffix in ("", "-wal", "-shm"):  # an index rebuild skips the newer file and keeps it
        (tmp_path / f"index.sqlite3{suffix}").unlink(missing_ok=True)
    with DiskStore(tmp_path, namespace="m") as store:
        assert same(store.get(old.key), old) and not store.contains(newer.key)
        assert store._path(newer.key).exists()
