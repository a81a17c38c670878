"""The disk tier's SQLite index, its rebuild from the self-describing chunk files alone, and its file helpers."""
from __future__ import annotations

import json
import os
import shutil
import sqlite3
import time
from collections.abc import Iterable
from pathlib import Path

import xxhash

from .base import ChunkMeta
from .serialize import FRAME, RecordError, UnsupportedFormatError, loads_namespaced_meta

INDEX = "index.sqlite3"
MANIFEST = "manifest.json"
MANIFEST_CONTENT = {"format": "kvboost-disk", "version": 1}
SUFFIX = ".kvb"
TMP_SUFFIX = ".tmp"

SCHEMA = """
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
META_COLS = "key, parent_key, content_key, token_ids, start"
UPSERT = (
    "INSERT INTO chunks (namespace, key, parent_key, content_key, start, n_tokens, token_ids, nbytes,"
    " checksum, path, last_access) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
    " ON CONFLICT(namespace, key) DO UPDATE SET nbytes = excluded.nbytes,"
    " checksum = excluded.checksum, path = excluded.path, last_access = excluded.last_access")


# ---- where a chunk lives ------------------------------------------------------------------------------
def namespace_dir(namespace: str) -> str:
    return xxhash.xxh3_64_hexdigest(namespace.encode())


def chunk_relpath(namespace: str, key: str) -> str:
    """A chunk file's path relative to the cache directory: a pure function of (namespace, key)."""
    return f"chunks/{namespace_dir(namespace)}/{xxhash.xxh3_128_hexdigest(key.encode())}{SUFFIX}"


def index_row(namespace: str, meta: ChunkMeta, blob: bytes, relpath: str) -> tuple:
    """The UPSERT parameters for one chunk file (a valid frame: its checksum is recorded)."""
    return (namespace, meta.key, meta.parent_key, meta.content_key, meta.start, len(meta.token_ids),
            json.dumps(list(meta.token_ids)), len(blob), format(FRAME.unpack_from(blob)[2], "016x"), relpath,
            time.time())


# ---- connections ------------------------------------------------------------------------------------
def connect(directory: Path, busy_timeout_s: float, check: bool = False) -> sqlite3.Connection:
    """The shared, writable index (WAL). check=True runs PRAGMA quick_check (by the first opener)."""
    conn = sqlite3.connect(directory / INDEX, timeout=busy_timeout_s, isolation_level=None, check_same_thread=False)
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.executescript(SCHEMA)
        conn.execute("SELECT COUNT(*) FROM chunks").fetchone()
        if check:
            verdict = conn.execute("PRAGMA quick_check").fetchone()
            if not verdict or verdict[0] != "ok":
                found = " ".join(str(verdict[0]).split())[:160] if verdict else "no answer"  # (one line, short)
                raise sqlite3.DatabaseError(f"quick_check: {found}")
    except Exception:
        conn.close()
        raise
    return conn


def connect_read_only(directory: Path) -> sqlite3.Connection:
    """The index of a directory we may not write: immutable when no writer holds the WAL's -shm file."""
    uri = (directory / INDEX).resolve().as_uri()
    for flags in ("?mode=ro", "?mode=ro&immutable=1"):
        conn = None
        try:
            conn = sqlite3.connect(uri + flags, uri=True, isolation_level=None, check_same_thread=False)
            conn.execute("SELECT COUNT(*) FROM chunks").fetchone()
            return conn
        except sqlite3.Error as exc:
            if conn is not None:
                conn.close()
            last = exc
    raise last


# ---- rebuilding from the files ------------------------------------------------------------------------
def scan_chunks(directory: Path) -> tuple[set[str], list[os.DirEntry]]:
    """(every chunk file under directory/chunks, as paths relative to directory; the temp files there)."""
    files: set[str] = set()
    tmps: list[os.DirEntry] = []
    root = directory / "chunks"
    for ns_dir in root.iterdir() if root.is_dir() else ():
        for entry in os.scandir(ns_dir) if ns_dir.is_dir() else ():
            if entry.name.endswith(SUFFIX):
                files.add(f"chunks/{ns_dir.name}/{entry.name}")
            elif entry.name.endswith(TMP_SUFFIX):
                tmps.append(entry)
    return files, tmps


def adopt(conn: sqlite3.Connection, directory: Path, relpaths: Iterable[str]) -> tuple[int, list[str]]:
    """Index every file of relpaths that verifies; returns (indexed, relpaths that did not); newer formats skipped."""
    kept, bad = 0, []
    for rel in sorted(relpaths):
        try:
            blob = (directory / rel).read_bytes()
            namespace, meta = loads_namespaced_meta(blob)  # checksum, header and the namespace it claims
        except UnsupportedFormatError:
            continue
        except (OSError, RecordError):
            bad.append(rel)
            continue
        if rel != chunk_relpath(namespace, meta.key):  # not where a put would write it: never trust it
            bad.append(rel)
            continue
        conn.execute(UPSERT, index_row(namespace, meta, blob, rel))
        kept += 1
    return kept, bad


# ---- the directory ----------------------------------------------------------------------------------
def tmp_is_dead(name: str, age_s: float, host: str, stale_s: float) -> bool:
    """Whether a temp file's writer is gone: old, or named by a dead process of this host."""
    if age_s > stale_s:
        return True
    parts = name.split(".")  # "", stem, host, pid, rand, "tmp"
    if len(parts) != 6 or parts[2] != host or not parts[3].isdigit():
        return False
    try:
        os.kill(int(parts[3]), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def existing_ancestor(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def default_disk_budget(directory: str | os.PathLike, cap_bytes: int = 16 * 1024**3) -> int:
    """Half of what the cache could occupy (free space + what it already holds), capped: never fill a disk."""
    directory = Path(directory).expanduser()
    free = shutil.disk_usage(existing_ancestor(directory)).free
    held = sum(e.stat().st_size for d in (directory / "chunks").glob("*") if d.is_dir() for e in os.scandir(d))
    return int(min(cap_bytes, (free + held) // 2))


def check_manifest(directory: Path) -> None:
    """Claim an empty directory for this format, or refuse one that holds another (RuntimeError)."""
    path = directory / MANIFEST
    try:
        found = json.loads(path.read_text())
    except FileNotFoundError:
        tmp = path.with_name(f".{MANIFEST}.{os.getpid()}{TMP_SUFFIX}")
        tmp.write_text(json.dumps(MANIFEST_CONTENT))
        os.replace(tmp, path)
        return
    if found != MANIFEST_CONTENT:
        raise RuntimeError(f"{path} describes another cache format: {found!r}")


def write_tmp(path: Path, blob: bytes, host: str) -> Path:
    """Write blob to a fresh temp file next to path, fsynced, and return its name."""
    # host + pid in the name let a later opener tell a dead writer's leftovers from a live one's.
    tmp = path.with_name(f".{path.stem}.{host}.{os.getpid()}.{os.urandom(4).hex()}{TMP_SUFFIX}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp
