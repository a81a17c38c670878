"""Redis tier: the disk tier's verified format, shared across hosts, bounded in latency. Every key has a TTL; an index
entry whose blob is gone is a miss and is removed. Short timeouts, no retries, and circuit breakers for connections and
reads (`breaker`, probed from a background thread) and for writes (`write_breaker`)."""
from __future__ import annotations

import contextlib
import functools
import itertools
import json
import threading
import time
from dataclasses import dataclass, field

from .base import ChunkMeta, ChunkRecord, CountedTier, TierHealth, TierStats
from .quant import QuantCodec
from .serialize import RecordError, UnsupportedFormatError, dumps, loads

try:  # optional dependency: kvboost[redis]
    import redis as _redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry
except ImportError:  # pragma: no cover - exercised only without redis-py
    _redis = None

# Unreachable: opens `breaker`; an error reply opens `breaker` for a read, `write_breaker` for a write.
_UNREACHABLE: tuple[type[BaseException], ...] = (OSError,)
_ERROR_REPLY: tuple[type[BaseException], ...] = ()
_READ_ONLY: tuple[type[BaseException], ...] = ()
if _redis is not None:
    _UNREACHABLE = (_redis.exceptions.ConnectionError, _redis.exceptions.TimeoutError, OSError)
    _ERROR_REPLY = (_redis.exceptions.ResponseError,)
    _READ_ONLY = (_redis.exceptions.ReadOnlyError,)


@dataclass
class CircuitBreaker:
    """closed -> (threshold consecutive failures) -> open -> (backoff elapsed) -> one probe -> closed/open. Each failed
    probe doubles the backoff up to max_backoff_s; a success resets it."""

    failure_threshold: int = 1  # one timeout is all a request may pay
    base_backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    failures: int = 0
    opened: int = 0
    _open_until: float | None = None  # None: closed
    _backoff_s: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def allow(self) -> bool:
        with self._lock:
            if self._open_until is None:
                return True
            now = time.monotonic()
            if now < self._open_until:
                return False
            self._open_until = now + self._backoff_s  # this caller probes; the others keep skipping
            return True

    def success(self) -> None:
        with self._lock:
            self.failures = 0
            self._open_until = None
            self._backoff_s = self.base_backoff_s

    def failure(self) -> None:
        with self._lock:
            self.failures += 1
            if self._open_until is not None:
                self._backoff_s = min(self.max_backoff_s, max(self._backoff_s, self.base_backoff_s) * 2)
            elif self.failures >= self.failure_threshold:
                self.opened += 1
                self._backoff_s = self.base_backoff_s
            else:
                return
            self._open_until = time.monotonic() + self._backoff_s

    @property
    def state(self) -> str:
        """"open" while allow() would refuse (read without taking the probe slot), then "half-open"."""
        with self._lock:
            if self._open_until is None:
                return "closed"
            return "open" if time.monotonic() < self._open_until else "half-open"


def _never_raises(default):
    """A cache must not fail a request: anything unexpected is counted as an error and answered with `default`."""
    def wrap(method):
        @functools.wraps(method)
        def safe(self, *args, **kwargs):
            try:
                return method(self, *args, **kwargs)
            except Exception:
                self._count("errors")
                return default() if callable(default) else default
        return safe
    return wrap


class RedisStore(CountedTier):
    name = "redis"

    def __init__(self, url: str, namespace: str, ttl_s: int | None = None, socket_timeout: float = 0.25,
                 bits: int = 16, breaker: CircuitBreaker | None = None):
        if _redis is None:
            from ..install_source import pip_install_extra

            raise ImportError(f"RedisStore needs redis-py: {pip_install_extra('redis')}")
        self.url, self.namespace = url, namespace
        self.ttl_s = int(ttl_s) if ttl_s else None
        self.codec = QuantCodec(bits) if bits < 16 else None
        self.breaker = breaker or CircuitBreaker()
        b = self.breaker
        self.write_breaker = CircuitBreaker(b.failure_threshold, b.base_backoff_s, b.max_backoff_s)
        # Reads refresh TTLs (writes): on a read-only replica they fall back to plain GET/SMEMBERS.
        self._sliding_ttl = self.ttl_s is not None
        self.health = TierHealth(self.name)
        self._prefix = f"kvboost:{namespace}:"
        # retry=0: redis-py would otherwise retry 10 times with backoff, turning a dead server into seconds.
        self.client = _redis.Redis.from_url(url, socket_timeout=socket_timeout, socket_connect_timeout=socket_timeout,
                                            retry=Retry(NoBackoff(), 0), health_check_interval=0)
        self._lock = threading.Lock()
        self._stats = TierStats(self.name)
        self._counters = {"short_circuited": 0, "corrupt_dropped": 0, "stale_index_cleaned": 0, "rejected_writes": 0}

    def _key(self, kind: str, name: str | None) -> str:
        """Redis key of a chunk's blob ("chunk"), its meta ("meta"), a parent's ("children") or content's index set."""
        return f"{self._prefix}{kind}:{json.dumps(name) if kind == 'children' else name}"

    # ---- reads -----------------------------------------------------------------------------------
    def _get(self, key: str) -> ChunkRecord | None:
        def fetch(pipe):
            for name in (self._key("chunk", key), self._key("meta", key)):
                if self._sliding_ttl:  # sliding expiry: a chunk in use stays
                    pipe.getex(name, ex=self.ttl_s)
                else:
                    pipe.get(name)
        results = self._run(fetch)
        if results is None:
            return None
        blob, raw_meta = results
        if blob is None:
            if raw_meta is not None:  # blob expired or was evicted before its index entry
                self._forget([(key, raw_meta)], "stale_index_cleaned")
            return None
        try:
            return loads(blob, self.namespace, key)
        except UnsupportedFormatError as exc:  # a newer kvboost's record: a miss, left in place
            self.health.event("unsupported_format", str(exc))
        except RecordError:
            self._forget([(key, raw_meta)], "corrupt_dropped")
        return None

    @_never_raises(False)
    def contains(self, key: str) -> bool:
        results = self._run(lambda p: p.exists(self._key("chunk", key)))
        return bool(results and results[0])

    @_never_raises(list)
    def children(self, parent_key: str | None) -> list[ChunkMeta]:
        return self._index_members(self._key("children", parent_key))

    @_never_raises(list)
    def by_content(self, content_key: str) -> list[ChunkMeta]:
        return self._index_members(self._key("content", content_key))

    def _index_members(self, set_key: str) -> list[ChunkMeta]:
        def read(pipe):
            pipe.smembers(set_key)
            if self._sliding_ttl:
                pipe.expire(set_key, self.ttl_s)  # an index in use stays as long as its members
        results = self._run(read)
        if not results or not results[0]:
            return []
        members = [m.decode() for m in results[0]]

        def check(pipe):
            for m in members:
                pipe.get(self._key("meta", m))
                pipe.exists(self._key("chunk", m))
        checked = self._run(check)
        if checked is None:
            return []
        metas: list[ChunkMeta] = []
        stale: list[tuple[str, bytes | None]] = []
        for member, raw_meta, has_blob in zip(members, checked[0::2], checked[1::2]):
            meta = _parse_meta(member, raw_meta)
            if meta is None or not has_blob:
                stale.append((member, raw_meta))
            else:
                metas.append(meta)
        if stale:  # one round trip however many members Redis evicted or expired
            self._forget(stale, "stale_index_cleaned", also_from=set_key)
        return metas

    def stats(self) -> TierStats:
        s = self._snapshot()
        for name, breaker in (("breaker", self.breaker), ("write_breaker", self.write_breaker)):
            s.extra[name], s.extra[f"{name}_opened"] = breaker.state, breaker.opened
        return s

    # ---- writes ----------------------------------------------------------------------------------
    @_never_raises(False)
    def put(self, record: ChunkRecord) -> bool:
        # Do not even serialize for a server we know is down or refusing writes.
        if self.breaker.state == "open" or self.write_breaker.state == "open":
            self._count("short_circuited")
            self.health.dropped("breaker_open")
            return False
        # A memoryview: redis-py would decode a refused command's multi-MB blob into the error message.
        blob = memoryview(dumps(record, self.namespace, self.codec))
        meta = json.dumps({"parent_key": record.parent_key, "content_key": record.content_key,
                           "start": record.start, "token_ids": list(record.token_ids)})

        def write(pipe):
            ex = self.ttl_s
            pipe.set(self._key("chunk", record.key), blob, ex=ex)
            pipe.set(self._key("meta", record.key), meta, ex=ex)
            for set_key in (self._key("children", record.parent_key), self._key("content", record.content_key)):
                pipe.sadd(set_key, record.key)
                if ex:
                    pipe.expire(set_key, ex)
        return self._run(write, transaction=True, write=True) is not None

    @_never_raises(None)
    def delete(self, key: str) -> None:
        if self.write_breaker.state == "open":
            self.health.dropped("breaker_open")
            return
        results = self._run(lambda p: p.get(self._key("meta", key)))
        self._forget([(key, results[0] if results else None)], None)

    def clear(self) -> None:
        """Delete every key of this namespace (SCAN, so a large keyspace does not block Redis)."""
        pattern = "".join("\\" + c if c in "*?[]\\" else c for c in self._prefix) + "*"  # the prefix glob-escaped
        try:
            if not self.breaker.allow() or not self.write_breaker.allow():
                self._count("short_circuited")
                self.health.dropped("breaker_open")
                return
            keys = self.client.scan_iter(match=pattern, count=1000)
            while batch := list(itertools.islice(keys, 1000)):
                self.client.delete(*batch)
            self.breaker.success()
            self.write_breaker.success()
        except Exception as exc:
            self._failed(exc, write=True)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.client.close()

    # ---- internals -------------------------------------------------------------------------------
    def _run(self, build, transaction: bool = False, write: bool = False) -> list | None:
        """Run one pipeline (one round trip); None on any failure, which is counted, never raised."""
        if self.breaker.state != "closed":
            if self.breaker.allow():  # this caller holds the probe slot: probe without making it wait
                threading.Thread(target=self._probe, name="kvboost-redis-probe", daemon=True).start()
            blocked = True
        else:
            blocked = write and not self.write_breaker.allow()  # (a write is the write breaker's probe)
        if blocked:
            self._count("short_circuited")
            if write:
                self.health.dropped("breaker_open")
            return None
        try:
            pipe = self.client.pipeline(transaction=transaction)
            build(pipe)
            results = pipe.execute(raise_on_error=True)
        except _READ_ONLY as exc:
            if write or not self._sliding_ttl:
                self._failed(exc, write)
                return None
            # A read-only replica refuses the TTL refresh our reads piggy-back: read without it from now on.
            self._sliding_ttl = False
            self.health.event("read_only_replica", "reads no longer refresh TTLs")
            return self._run(build, transaction, write)
        except Exception as exc:
            self._failed(exc, write)
            return None
        self.breaker.success()
        if write:
            self.write_breaker.success()
        return results

    def _probe(self) -> None:
        """Is the server back? Answers the breaker, off every request's path."""
        try:
            self.client.ping()
        except Exception as exc:
            self._failed(exc, write=False)
            return
        self.breaker.success()

    def _failed(self, exc: Exception, write: bool) -> None:
        """Count a failure by reason and feed the breaker it concerns."""
        self._count("errors")
        if isinstance(exc, _UNREACHABLE):
            self.breaker.failure()
            self.health.event("unreachable", type(exc).__name__)
            reason = "unreachable"
        elif isinstance(exc, _ERROR_REPLY):
            # The server's words (redis-py prefixes pipeline errors with the command, which may be a blob).
            said = (str(exc.args[0]) if exc.args else type(exc).__name__).split("caused error: ")[-1][:200]
            self.health.event("write_refused" if write else "error_reply", f"{type(exc).__name__}: {said}")
            reason = "refused"
            if write:
                self.breaker.success()  # the server answered: it is up, just unwilling to store
                self.write_breaker.failure()
                self._count("rejected_writes")
            else:
                self.breaker.failure()  # a read it will not answer: skip it like one that cannot
        else:  # not Redis's doing (a bug, a value it cannot encode): counted, breakers untouched
            self.health.event("error", type(exc).__name__)
            reason = "error"
        if write:
            self.health.dropped(reason)

    def _forget(self, entries: list[tuple[str, bytes | None]], counter: str | None,
                also_from: str | None = None) -> None:
        """Remove keys' blobs, metas and index memberships in one round trip (best effort)."""
        def drop(pipe):
            for key, raw_meta in entries:
                meta = _parse_meta(key, raw_meta)
                sets = {also_from} if also_from else set()
                if meta is not None:
                    sets |= {self._key("children", meta.parent_key), self._key("content", meta.content_key)}
                pipe.delete(self._key("chunk", key), self._key("meta", key))
                for set_key in sets:
                    pipe.srem(set_key, key)
        self._run(drop, write=True)
        if counter:
            self._count(counter, len(entries))


def _parse_meta(key: str, raw: bytes | None) -> ChunkMeta | None:
    if raw is None:
        return None
    try:
        d = json.loads(raw)
        return ChunkMeta(key, d["parent_key"], d["content_key"], tuple(int(t) for t in d["token_ids"]), int(d["start"]))
    except (ValueError, KeyError, TypeError):
        return None
