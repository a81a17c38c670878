"""Disk tier: one verified file per chunk plus a SQLite index, safe to share between processes. The blob goes to an
fsynced temp file, renamed into place in the index row's write transaction; every read re-verifies it. Every public
method swallows backend errors (counted): a cache must not fail a request."""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from . import disk_index as idx
from .base import ChunkMeta, ChunkRecord, CountedTier, TierHealth, TierStats
from .quant import QuantCodec
from .serialize import RecordError, UnsupportedFormatError, dumps, loads

# errno values that mean "this directory cannot be written", as opposed to "this write failed"
_READ_ONLY_ERRNOS = {errno.EROFS, errno.EACCES, errno.EPERM}
_READ_BUSY_MS = 100
_BUSY_TIMEOUT_S = 5.0  # how long a write waits for other writers
_STALE_TMP_S = 600.0  # a temp file this old is a dead writer's, whoever wrote it


class DiskStore(CountedTier):
    name = "disk"

    def __init__(self, directory: str | os.PathLike, budget_bytes: int | None = None, namespace: str = "default",
                 bits: int = 16):
        self.directory = Path(directory).expanduser()
        self.budget_bytes = int(budget_bytes) if budget_bytes is not None else None
        self.namespace = namespace
        self.codec = QuantCodec(bits) if bits < 16 else None
        self._host = socket.gethostname().replace(".", "_")
        # Two connections, so a read never queues behind the write-behind thread's write transactions.
        self._lock = threading.RLock()  # guards _conn (reads)
        self._write_lock = threading.RLock()  # guards _wconn (write transactions)
        self._stats = TierStats(self.name, budget_bytes=self.budget_bytes)
        self._counters = {"corrupt_dropped": 0, "missing_files": 0, "swept_tmp": 0, "swept_orphans": 0,
                          "adopted_files": 0}
        self.health = TierHealth(self.name)
        self.disabled: str | None = None  # why this store serves nothing, if it cannot be used safely
        self.read_only: str | None = None  # why this store serves hits but writes nothing
        self._unservable: set[str] = set()  # never served: damaged files we may not delete (read-only), newer formats
        self._conn: sqlite3.Connection | None = None
        self._wconn: sqlite3.Connection | None = None
        self._pid = os.getpid()
        self._lock_fd: int | None = None
        try:
            self._open()
        except Exception as exc:  # an unusable directory degrades to "always miss", never to a crash
            self.disabled = f"{type(exc).__name__}: {exc}"
            self._stats.errors += 1
            self._release()  # never keep the directory lock (an exclusive one would block every other opener)
            self.health.event("disabled", f"{self.directory}: {self.disabled}; the disk tier serves nothing")

    # ---- lifecycle -----------------------------------------------------------------------------
    def _open(self) -> None:
        if not _writable(self.directory):
            return self._open_read_only("read-only directory")
        try:
            (self.directory / "chunks" / idx.namespace_dir(self.namespace)).mkdir(parents=True, exist_ok=True)
            idx.check_manifest(self.directory)
            self._lock_fd = os.open(self.directory / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            if exc.errno not in _READ_ONLY_ERRNOS:
                raise
            return self._open_read_only(f"{type(exc).__name__}: {exc}")
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            alone = True
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            alone = False
        if not alone:
            self._shared_lock()
        damaged: Exception | None = None
        try:
            self._conn = idx.connect(self.directory, _BUSY_TIMEOUT_S, check=alone)
        except sqlite3.DatabaseError as exc:  # not a database, malformed, quick_check failed
            # OperationalError (locked, I/O error, permissions) is not damage, so nothing is rebuilt; nor while
            # others have it open: rebuilding now would pull it from under them
            if isinstance(exc, sqlite3.OperationalError) or not alone:
                raise
            damaged = exc
            for suffix in ("", "-wal", "-shm"):  # rebuilt from the chunk files by the sweep below
                (self.directory / f"{idx.INDEX}{suffix}").unlink(missing_ok=True)
            self._conn = idx.connect(self.directory, _BUSY_TIMEOUT_S)
        self._conn.execute(f"PRAGMA busy_timeout = {_READ_BUSY_MS}")  # a hit count is not worth waiting for
        if alone:
            adopted, removed = self._sweep(everything=True)
            fcntl.flock(self._lock_fd, fcntl.LOCK_SH)  # others may open (and share) from now on
            if damaged is not None:
                self.health.event("index_rebuilt", f"{type(damaged).__name__}: {damaged}; rebuilt from the chunk "
                                  f"files: kept {adopted}, removed {removed} that failed verification")
        else:
            self._sweep(everything=False)

    def _open_read_only(self, why: str) -> None:
        """Serve what the directory holds without writing a byte: no manifest, lock, sweep or hit counts."""
        self.read_only = why
        if (self.directory / idx.MANIFEST).exists():
            idx.check_manifest(self.directory)
        with contextlib.suppress(FileNotFoundError):
            self._lock_fd = os.open(self.directory / ".lock", os.O_RDONLY)
            self._shared_lock()
        self._conn, detail = self._read_only_index()
        self.health.event("read_only", f"{self.directory}: {why}; serving hits, skipping writes ({detail})")

    def _read_only_index(self) -> tuple[sqlite3.Connection, str]:
        try:
            return idx.connect_read_only(self.directory), "index opened read-only"
        except (sqlite3.Error, OSError) as exc:  # missing, damaged, or a WAL index we may not open
            conn = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
            conn.executescript(idx.SCHEMA)
            kept, bad = idx.adopt(conn, self.directory, idx.scan_chunks(self.directory)[0])
            return conn, (f"index unusable ({type(exc).__name__}: {exc}); indexed {kept} chunk files in memory, "
                          f"{len(bad)} failed verification")

    def _shared_lock(self) -> None:
        """Waits only while another opener (the one that sweeps) holds the lock exclusively."""
        deadline = time.monotonic() + 30.0
        while True:
            try:
                fcntl.flock(self._lock_fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                return
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES) or time.monotonic() > deadline:
                    raise
            time.sleep(0.01)

    def _db(self) -> sqlite3.Connection:
        """The read connection, reopened in a forked child: SQLite connections must not cross fork()."""
        if self._pid != os.getpid():
            self._wconn = None  # (the parent's handles are left to the parent)
            if self.read_only:
                self._conn = self._read_only_index()[0]
            else:
                self._conn = idx.connect(self.directory, _BUSY_TIMEOUT_S)
                self._conn.execute(f"PRAGMA busy_timeout = {_READ_BUSY_MS}")
            self._pid = os.getpid()
        return self._conn

    def close(self) -> None:
        with self._write_lock, self._lock:
            self._release()
            if self.disabled is None:
                self.disabled = "closed"

    def _release(self) -> None:
        for conn in (self._wconn, self._conn):
            if conn is not None:
                with contextlib.suppress(sqlite3.Error):
                    conn.close()
        self._conn = self._wconn = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    def __enter__(self) -> DiskStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- reads ---------------------------------------------------------------------------------
    def _get(self, key: str) -> ChunkRecord | None:
        if self.disabled or key in self._unservable:
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
        except UnsupportedFormatError as exc:  # a newer kvboost's record: not ours to delete, never served
            self._unservable.add(key)
            self.health.event("unsupported_format", f"{path.name}: {exc}")
            return None
        except RecordError:
            self._drop(key, path, st, "corrupt_dropped")
            return None
        if not self.read_only:
            try:
                with self._lock:
                    self._db().execute("UPDATE chunks SET hits = hits + 1, last_access = ? "
                                       "WHERE namespace = ? AND key = ?", (time.time(), self.namespace, key))
            except sqlite3.Error:
                self._count("errors")  # a busy index only costs us a hit count; the data is verified and good
        return record

    def contains(self, key: str) -> bool:
        return key not in self._unservable and bool(
            self._query("SELECT 1 FROM chunks WHERE namespace = ? AND key = ?", (self.namespace, key)))

    def children(self, parent_key: str | None) -> list[ChunkMeta]:
        return self._metas("parent_key IS ?", parent_key)

    def by_content(self, content_key: str) -> list[ChunkMeta]:
        return self._metas("content_key = ?", content_key)

    def _metas(self, condition: str, value: str | None) -> list[ChunkMeta]:
        metas = []
        for row in self._query(f"SELECT {idx.META_COLS} FROM chunks WHERE namespace = ? AND {condition}",
                               (self.namespace, value)):
            if row[0] in self._unservable:
                continue
            try:
                metas.append(ChunkMeta(*row[:3], tuple(json.loads(row[3])), row[4]))
            except (ValueError, TypeError):  # a damaged index row: skip it, get() will judge the file
                self._count("errors")
        return metas

    def keys(self) -> list[str]:
        rows = self._query("SELECT key FROM chunks WHERE namespace = ?", (self.namespace,))
        return [r[0] for r in rows if r[0] not in self._unservable]

    def stats(self) -> TierStats:
        rows = self._query("SELECT COUNT(*), COALESCE(SUM(nbytes), 0) FROM chunks WHERE namespace = ?",
                           (self.namespace,))
        total = self._query("SELECT COALESCE(SUM(nbytes), 0) FROM chunks", ())
        s = self._snapshot()
        if rows:
            s.entries, s.bytes = rows[0]
        s.extra["directory_bytes"] = total[0][0] if total else 0
        s.extra.update({name: why for name, why in (("disabled", self.disabled), ("read_only", self.read_only)) if why})
        return s

    # ---- writes --------------------------------------------------------------------------------
    def put(self, record: ChunkRecord) -> bool:
        if not self._may_write():
            return False
        tmp: Path | None = None
        try:
            path = self._path(record.key)
            if self._query("SELECT 1 FROM chunks WHERE namespace = ? AND key = ?", (self.namespace, record.key)) \
                    and path.exists():
                return True  # chunk K/V are a pure function of the key: nothing to rewrite
            blob = dumps(record, self.namespace, self.codec)
            if self.budget_bytes is not None and len(blob) > self.budget_bytes:
                self.health.dropped("over_budget", f"a {len(blob)}-byte chunk exceeds the whole disk budget")
                return False
            tmp = idx.write_tmp(path, blob, self._host)
            row = idx.index_row(self.namespace, record.meta(), blob, str(path.relative_to(self.directory)))
            with self._write_txn() as conn:
                os.replace(tmp, path)
                tmp = None
                conn.execute(idx.UPSERT, row)
                self._evict_over_budget(conn, protect=record.key)
            return True
        except Exception as exc:
            self._write_failed(exc)
            return False
        finally:
            if tmp is not None:
                tmp.unlink(missing_ok=True)

    def delete(self, key: str) -> None:
        self._remove("namespace = ? AND key = ?", (self.namespace, key))

    def clear(self) -> None:
        """Drop this namespace's entries (other namespaces sharing the directory are left alone)."""
        self._remove("namespace = ?", (self.namespace,))

    def _remove(self, where: str, params: tuple) -> None:
        """Delete the index rows matching `where` and their files; a failure is counted (with why), never raised."""
        if not self._may_write():
            return
        try:
            with self._write_txn() as conn:
                rows = conn.execute(f"SELECT path FROM chunks WHERE {where}", params).fetchall()
                conn.execute(f"DELETE FROM chunks WHERE {where}", params)
                for (rel,) in rows:
                    (self.directory / rel).unlink(missing_ok=True)
        except Exception as exc:
            self._write_failed(exc)

    def _may_write(self) -> bool:
        """False (and the write counted as dropped, with why) when this store does not write."""
        for reason, why in (("disabled", self.disabled), ("read_only", self.read_only)):
            if why:
                self.health.dropped(reason, why)
                return False
        return True

    def _write_failed(self, exc: Exception) -> None:
        """Count a failed write by reason; a directory that turned read-only stops taking writes at all."""
        self._count("errors")
        code = getattr(exc, "errno", None) if isinstance(exc, OSError) else None
        if code in _READ_ONLY_ERRNOS or (isinstance(exc, sqlite3.OperationalError) and "readonly" in str(exc)):
            self.read_only = f"{type(exc).__name__}: {exc}"
            self.health.event("read_only", f"{self.directory} became read-only ({self.read_only}); "
                              "serving hits, skipping writes")
            self.health.dropped("read_only", self.read_only)
        elif code in (errno.ENOSPC, errno.EDQUOT):
            self.health.dropped("no_space", f"{type(exc).__name__}: {exc}")
        else:
            self.health.dropped("error", f"{type(exc).__name__}: {exc}")

    # ---- internals -----------------------------------------------------------------------------
    def _path(self, key: str) -> Path:
        return self.directory / idx.chunk_relpath(self.namespace, key)

    @contextmanager
    def _write_txn(self) -> Iterator[sqlite3.Connection]:
        if self.disabled:
            raise RuntimeError(f"disk store disabled: {self.disabled}")
        with self._write_lock:
            self._db()  # (fork check)
            if self._wconn is None:  # opened on first write, waiting up to _BUSY_TIMEOUT_S for other writers
                self._wconn = idx.connect(self.directory, _BUSY_TIMEOUT_S)
            conn = self._wconn
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
            (self.directory / rel).unlink(missing_ok=True)
        self._count("evictions", len(doomed))

    def _drop(self, key: str, path: Path, seen: os.stat_result | None, counter: str) -> None:
        """Remove a damaged/missing entry, unless another process replaced the file since we read it."""
        if self.read_only:  # may not delete it: never serve it again instead
            self._unservable.add(key)
            self._count(counter)
            return
        try:
            with self._write_txn() as conn:
                try:
                    now = os.stat(path)
                except FileNotFoundError:
                    now = None
                if now is not None and (seen is None or (now.st_ino, now.st_mtime_ns)
                                        != (seen.st_ino, seen.st_mtime_ns)):
                    return  # a concurrent put wrote a fresh file since our read
                conn.execute("DELETE FROM chunks WHERE namespace = ? AND key = ?", (self.namespace, key))
                if now is not None:
                    path.unlink(missing_ok=True)
            self._count(counter)
        except Exception:
            self._count("errors")

    def _sweep(self, everything: bool) -> tuple[int, int]:
        """Remove dead writers' temp files; alone, also fix the index both ways. Returns (adopted, removed)."""
        files, tmps = idx.scan_chunks(self.directory)
        now = time.time()
        for entry in tmps:
            if everything or idx.tmp_is_dead(entry.name, now - entry.stat().st_mtime, self._host, _STALE_TMP_S):
                Path(entry.path).unlink(missing_ok=True)
                self._counters["swept_tmp"] += 1
        if not everything:
            return 0, 0
        for tmp in self.directory.glob(f".{idx.MANIFEST}.*{idx.TMP_SUFFIX}"):
            tmp.unlink(missing_ok=True)
        with self._write_txn() as conn:
            indexed = {rel for (rel,) in conn.execute("SELECT path FROM chunks")}
            for rel in indexed - files:
                conn.execute("DELETE FROM chunks WHERE path = ?", (rel,))
            adopted, bad = idx.adopt(conn, self.directory, files - indexed)
            for rel in bad:
                (self.directory / rel).unlink(missing_ok=True)
            self._counters["swept_orphans"] += len(indexed - files) + len(bad)
            self._counters["adopted_files"] += adopted
            if adopted:
                self._evict_over_budget(conn, protect="")
        return adopted, len(bad)


def _writable(directory: Path) -> bool:
    """Whether we may write (or create) the directory; access() reports a read-only mount even to root."""
    return os.access(idx.existing_ancestor(directory), os.W_OK)
