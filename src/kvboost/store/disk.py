"""Disk tier: one verified file per chunk plus a SQLite index, safe to share between processes.

Crash safety comes from ordering, not from hoping nothing dies:
  1. the blob is written to a temp file in the target directory and fsynced (a kill here leaves a
     temp file, swept at the next open);
  2. inside one SQLite write transaction (BEGIN IMMEDIATE: one writer across all processes) the temp
     file is renamed over the final name and the index row is upserted (a kill between the two
     leaves an unindexed file, never served, swept by the next exclusive open);
  3. every read re-verifies the blob's checksum, namespace and key; a bad file is deleted with its row
     and counted, never served.
Eviction and deletes remove the row and unlink the file inside the same kind of transaction, so a
concurrent writer of the same key either lands before (and is evicted) or after (and survives).

Every public method swallows backend errors (counted in stats().errors): a cache must not fail a request.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import socket
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import xxhash

from .base import ChunkMeta, ChunkRecord, CountedTier, TierStats
from .quant import DEFAULT_GROUP_SIZE, QuantCodec
from .serialize import RecordError, dumps, frame_checksum, loads

MANIFEST = "manifest.json"
MANIFEST_CONTENT = {"format": "kvboost-disk", "version": 1}
_SUFFIX = ".kvb"
_TMP_SUFFIX = ".tmp"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS chunks (
    namespace   TEXT NOT NULL,
    key         TEXT NOT NULL,
    parent_key  TEXT,
    content_key TEXT NOT NULL,
    start       INTEGER NOT NULL,
    n_tokens    INTEGER NOT NULL,
    token_ids   TEXT NOT NULL,
    nbytes      INTEGER NOT NULL,
    checksum    TEXT NOT NULL,
    path        TEXT NOT NULL,
    hits        INTEGER NOT NULL DEFAULT 0,
    last_access REAL NOT NULL,
    PRIMARY KEY (namespace, key)
);
CREATE INDEX IF NOT EXISTS chunks_parent ON chunks(namespace, parent_key);
CREATE INDEX IF NOT EXISTS chunks_content ON chunks(namespace, content_key);
CREATE INDEX IF NOT EXISTS chunks_eviction ON chunks(hits, last_access);
"""
_META_COLS = "key, parent_key, content_key, token_ids, start"


class DiskStore(CountedTier):
    name = "disk"

    def __init__(self, directory: str | os.PathLike, budget_bytes: int | None = None, namespace: str = "default",
                 bits: int = 16, group_size: int = DEFAULT_GROUP_SIZE, fsync: bool = True,
                 busy_timeout_s: float = 5.0, stale_tmp_s: float = 600.0):
        self.directory = Path(directory)
        self.budget_bytes = int(budget_bytes) if budget_bytes is not None else None
        self.namespace = namespace
        self.codec = QuantCodec(bits, group_size) if bits < 16 else None
        self.fsync = fsync
        self.stale_tmp_s = stale_tmp_s
        self._ns_dir = self.directory / "chunks" / xxhash.xxh3_64_hexdigest(namespace.encode())
        self._host = socket.gethostname().replace(".", "_")
        self._lock = threading.RLock()
        self._stats = TierStats(self.name, budget_bytes=self.budget_bytes)
        self._counters = {"corrupt_dropped": 0, "missing_files": 0, "swept_tmp": 0, "swept_orphans": 0}
        self.disabled: str | None = None  # why this store serves nothing, if it cannot be used safely
        self._conn: sqlite3.Connection | None = None
        self._pid = os.getpid()
        self._busy_timeout_s = busy_timeout_s
        self._lock_fd: int | None = None
        try:
            self._open(busy_timeout_s)
        except Exception as exc:  # an unusable directory degrades to "always miss", never to a crash
            self.disabled = f"{type(exc).__name__}: {exc}"
            self._stats.errors += 1
            self._release()  # never keep the directory lock (an exclusive one would block every other opener)

    # ---- lifecycle -----------------------------------------------------------------------------
    def _open(self, busy_timeout_s: float) -> None:
        self._ns_dir.mkdir(parents=True, exist_ok=True)
        self._check_manifest()
        self._lock_fd = os.open(self.directory / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            alone = True
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            alone = False
        if not alone:
            self._shared_lock(timeout_s=max(30.0, busy_timeout_s))  # waits only while another opener sweeps
        try:
            self._conn = self._connect(busy_timeout_s)
        except sqlite3.DatabaseError:
            if not alone:
                raise
            self._remove_index_files()  # a corrupt index is rebuilt empty; the sweep drops its files
            self._conn = self._connect(busy_timeout_s)
        if alone:
            self._sweep(everything=True)
            fcntl.flock(self._lock_fd, fcntl.LOCK_SH)  # others may open (and share) from now on
        else:
            self._sweep(everything=False)

    def _shared_lock(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(self._lock_fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                return
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES) or time.monotonic() > deadline:
                    raise
            time.sleep(0.01)

    def _connect(self, busy_timeout_s: float) -> sqlite3.Connection:
        conn = sqlite3.connect(self.directory / "index.sqlite3", timeout=busy_timeout_s, isolation_level=None,
                               check_same_thread=False)
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.executescript(_SCHEMA)
            conn.execute("SELECT COUNT(*) FROM chunks").fetchone()
        except Exception:
            conn.close()
            raise
        return conn

    def _db(self) -> sqlite3.Connection:
        """The connection, reopened in a forked child: SQLite connections must not cross fork()."""
        if self._pid != os.getpid():
            self._conn = self._connect(self._busy_timeout_s)  # the parent's handle is left to the parent
            self._pid = os.getpid()
        return self._conn

    def _remove_index_files(self) -> None:
        for suffix in ("", "-wal", "-shm"):
            try:
                os.unlink(self.directory / f"index.sqlite3{suffix}")
            except FileNotFoundError:
                pass

    def _check_manifest(self) -> None:
        path = self.directory / MANIFEST
        try:
            found = json.loads(path.read_text())
        except FileNotFoundError:
            tmp = path.with_name(f".{MANIFEST}.{os.getpid()}{_TMP_SUFFIX}")
            tmp.write_text(json.dumps(MANIFEST_CONTENT))
            os.replace(tmp, path)
            return
        if found != MANIFEST_CONTENT:
            raise RuntimeError(f"{path} describes another cache format: {found!r}")

    def close(self) -> None:
        with self._lock:
            self._release()
            if self.disabled is None:
                self.disabled = "closed"

    def _release(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            except sqlite3.Error:
                pass
            self._conn = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    def __enter__(self) -> DiskStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- reads ---------------------------------------------------------------------------------
    def _get(self, key: str) -> ChunkRecord | None:
        if self.disabled:
            return None
        with self._lock:
            row = self._db().execute("SELECT path FROM chunks WHERE namespace = ? AND key = ?",
                                     (self.namespace, key)).fetchone()
        if row is None:
            return None
        path = self.directory / row[0]
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                blob = f.read()
        except FileNotFoundError:
            self._drop(key, path, None, "missing_files")
            return None
        try:
            record = loads(blob, self.namespace, key)
        except RecordError:
            self._drop(key, path, st, "corrupt_dropped")
            return None
        try:
            with self._lock:
                self._db().execute("UPDATE chunks SET hits = hits + 1, last_access = ? WHERE namespace = ? AND key = ?",
                                   (time.time(), self.namespace, key))
        except sqlite3.Error:
            self._count("errors")  # a busy index only costs us a hit count; the data is verified and good
        return record

    def contains(self, key: str) -> bool:
        return bool(self._query("SELECT 1 FROM chunks WHERE namespace = ? AND key = ?", (self.namespace, key)))

    def children(self, parent_key: str | None) -> list[ChunkMeta]:
        rows = self._query(f"SELECT {_META_COLS} FROM chunks WHERE namespace = ? AND parent_key IS ?",
                           (self.namespace, parent_key))
        return self._metas(rows)

    def by_content(self, content_key: str) -> list[ChunkMeta]:
        rows = self._query(f"SELECT {_META_COLS} FROM chunks WHERE namespace = ? AND content_key = ?",
                           (self.namespace, content_key))
        return self._metas(rows)

    def _metas(self, rows: list[tuple]) -> list[ChunkMeta]:
        metas = []
        for row in rows:
            try:
                metas.append(_row_meta(row))
            except (ValueError, TypeError):  # a damaged index row: skip it, get() will judge the file
                self._count("errors")
        return metas

    def keys(self) -> list[str]:
        return [r[0] for r in self._query("SELECT key FROM chunks WHERE namespace = ?", (self.namespace,))]

    def stats(self) -> TierStats:
        rows = self._query("SELECT COUNT(*), COALESCE(SUM(nbytes), 0) FROM chunks WHERE namespace = ?",
                           (self.namespace,))
        total = self._query("SELECT COALESCE(SUM(nbytes), 0) FROM chunks", ())
        with self._lock:
            s = TierStats(**vars(self._stats))
            s.extra = dict(self._counters)
        if rows:
            s.entries, s.bytes = rows[0]
        s.extra["directory_bytes"] = total[0][0] if total else 0
        if self.disabled:
            s.extra["disabled"] = self.disabled
        return s

    # ---- writes --------------------------------------------------------------------------------
    def put(self, record: ChunkRecord) -> bool:
        if self.disabled:
            return False
        tmp: Path | None = None
        try:
            path = self._path(record.key)
            if self._query("SELECT 1 FROM chunks WHERE namespace = ? AND key = ?", (self.namespace, record.key)) \
                    and path.exists():
                return True  # chunk K/V are a pure function of the key: nothing to rewrite
            blob = dumps(record, self.namespace, self.codec)
            if self.budget_bytes is not None and len(blob) > self.budget_bytes:
                return False
            tmp = self._write_tmp(path, blob)
            row = (self.namespace, record.key, record.parent_key, record.content_key, record.start,
                   len(record.token_ids), json.dumps(list(record.token_ids)), len(blob),
                   format(frame_checksum(blob), "016x"), str(path.relative_to(self.directory)), time.time())
            with self._write_txn() as conn:
                os.replace(tmp, path)
                tmp = None
                conn.execute(
                    "INSERT INTO chunks (namespace, key, parent_key, content_key, start, n_tokens, token_ids, nbytes,"
                    " checksum, path, last_access) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
                    " ON CONFLICT(namespace, key) DO UPDATE SET nbytes = excluded.nbytes,"
                    " checksum = excluded.checksum, path = excluded.path, last_access = excluded.last_access", row)
                self._evict_over_budget(conn, protect=record.key)
            return True
        except Exception:
            self._count("errors")
            return False
        finally:
            if tmp is not None:
                _unlink(tmp)

    def delete(self, key: str) -> None:
        try:
            with self._write_txn() as conn:
                row = conn.execute("SELECT path FROM chunks WHERE namespace = ? AND key = ?",
                                   (self.namespace, key)).fetchone()
                conn.execute("DELETE FROM chunks WHERE namespace = ? AND key = ?", (self.namespace, key))
                if row:
                    _unlink(self.directory / row[0])
        except Exception:
            self._count("errors")

    def clear(self) -> None:
        """Drop this namespace's entries (other namespaces sharing the directory are left alone)."""
        try:
            with self._write_txn() as conn:
                rows = conn.execute("SELECT path FROM chunks WHERE namespace = ?", (self.namespace,)).fetchall()
                conn.execute("DELETE FROM chunks WHERE namespace = ?", (self.namespace,))
                for (rel,) in rows:
                    _unlink(self.directory / rel)
        except Exception:
            self._count("errors")

    # ---- internals -----------------------------------------------------------------------------
    def _path(self, key: str) -> Path:
        return self._ns_dir / (xxhash.xxh3_128_hexdigest(key.encode()) + _SUFFIX)

    def _write_tmp(self, path: Path, blob: bytes) -> Path:
        # host + pid in the name let a later opener tell a dead writer's leftovers from a live one's.
        tmp = path.with_name(f".{path.stem}.{self._host}.{os.getpid()}.{os.urandom(4).hex()}{_TMP_SUFFIX}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
                f.flush()
                if self.fsync:
                    os.fsync(f.fileno())
        except BaseException:
            _unlink(tmp)
            raise
        return tmp

    @contextmanager
    def _write_txn(self) -> Iterator[sqlite3.Connection]:
        if self.disabled:
            raise RuntimeError(f"disk store disabled: {self.disabled}")
        with self._lock:
            conn = self._db()
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")

    def _query(self, sql: str, params: tuple) -> list[tuple]:
        if self.disabled:
            return []
        try:
            with self._lock:
                return self._db().execute(sql, params).fetchall()
        except Exception:
            self._count("errors")
            return []

    def _evict_over_budget(self, conn: sqlite3.Connection, protect: str) -> None:
        """Budget is for the whole directory (it is one disk), so victims may come from any namespace."""
        if self.budget_bytes is None:
            return
        total = conn.execute("SELECT COALESCE(SUM(nbytes), 0) FROM chunks").fetchone()[0]
        if total <= self.budget_bytes:
            return
        victims = conn.execute("SELECT namespace, key, path, nbytes FROM chunks ORDER BY hits ASC, last_access ASC")
        doomed = []
        for ns, key, rel, nbytes in victims:
            if total <= self.budget_bytes:
                break
            if ns == self.namespace and key == protect:
                continue  # the chunk just written has no hits yet; evicting it would make every put a no-op
            doomed.append((ns, key, rel))
            total -= nbytes
        for ns, key, rel in doomed:
            conn.execute("DELETE FROM chunks WHERE namespace = ? AND key = ?", (ns, key))
            _unlink(self.directory / rel)
        self._count("evictions", len(doomed))

    def _drop(self, key: str, path: Path, seen: os.stat_result | None, counter: str) -> None:
        """Remove a damaged/missing entry, unless another process replaced the file since we read it."""
        try:
            with self._write_txn() as conn:
                try:
                    now = os.stat(path)
                except FileNotFoundError:
                    now = None
                same_file = seen is not None and now is not None and \
                    (now.st_ino, now.st_mtime_ns) == (seen.st_ino, seen.st_mtime_ns)
                if now is not None and not same_file:  # a concurrent put wrote a fresh file since our read
                    return
                conn.execute("DELETE FROM chunks WHERE namespace = ? AND key = ?", (self.namespace, key))
                if now is not None:
                    _unlink(path)
            self._count(counter)
        except Exception:
            self._count("errors")

    def _sweep(self, everything: bool) -> None:
        """Remove dead writers' temp files; when alone, also unindexed files and rows without files."""
        chunks_root = self.directory / "chunks"
        now = time.time()
        files: set[str] = set()
        for ns_dir in chunks_root.iterdir():
            if not ns_dir.is_dir():
                continue
            for entry in os.scandir(ns_dir):
                if entry.name.endswith(_TMP_SUFFIX):
                    if everything or self._tmp_is_dead(entry.name, now - entry.stat().st_mtime):
                        _unlink(Path(entry.path))
                        self._counters["swept_tmp"] += 1
                elif entry.name.endswith(_SUFFIX):
                    files.add(str(Path(entry.path).relative_to(self.directory)))
        for tmp in self.directory.glob(f".{MANIFEST}.*{_TMP_SUFFIX}"):
            if everything:
                _unlink(tmp)
        if not everything:
            return
        with self._write_txn() as conn:
            indexed = {rel for (rel,) in conn.execute("SELECT path FROM chunks")}
            for rel in indexed - files:
                conn.execute("DELETE FROM chunks WHERE path = ?", (rel,))
            for rel in files - indexed:
                _unlink(self.directory / rel)
            self._counters["swept_orphans"] += len(indexed - files) + len(files - indexed)

    def _tmp_is_dead(self, name: str, age_s: float) -> bool:
        if age_s > self.stale_tmp_s:
            return True
        parts = name.split(".")  # "", stem, host, pid, rand, "tmp"
        if len(parts) != 6 or parts[2] != self._host or not parts[3].isdigit():
            return False
        try:
            os.kill(int(parts[3]), 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False



def default_disk_budget(directory: str | os.PathLike, cap_bytes: int = 16 * 1024**3) -> int:
    """Half of what the cache could occupy (free space + what it already holds), capped: never fill a disk."""
    directory = Path(directory)
    probe = directory
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    held = sum(e.stat().st_size for d in (directory / "chunks").glob("*") if d.is_dir() for e in os.scandir(d))
    return int(min(cap_bytes, (free + held) // 2))


def _row_meta(row: tuple) -> ChunkMeta:
    key, parent_key, content_key, token_ids, start = row
    return ChunkMeta(key, parent_key, content_key, tuple(json.loads(token_ids)), start)


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
