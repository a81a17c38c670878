"""Memory -> host -> disk -> Redis, behind the one ChunkStore interface the engine uses. get() promotes lower-tier
hits into memory; disk and Redis writes go through a bounded write-behind queue (writeback.py). A key lives in exactly
one of memory and host: moves happen under one lock (`_fast`)."""
from __future__ import annotations

import os
import threading
from collections import Counter
from collections.abc import Callable

from .base import ChunkMeta, ChunkRecord, ChunkStore, TierStats
from .disk import DiskStore
from .disk_index import default_disk_budget
from .host import HostStore
from .memory import MemoryStore
from .quant import QuantCodec
from .redis import RedisStore
from .writeback import DEFAULT_FLUSH_TIMEOUT_S, DEFAULT_QUEUE_BYTES, WriteBehind, flush_targets


class TieredStore:
    name = "tiered"

    def __init__(self, memory: MemoryStore, disk: ChunkStore | None = None, redis: ChunkStore | None = None,
                 write_through_disk: bool = False, write_queue_bytes: int = DEFAULT_QUEUE_BYTES,
                 flush_timeout_s: float = DEFAULT_FLUSH_TIMEOUT_S, host: HostStore | None = None):
        self.memory, self.host, self.disk, self.redis = memory, host, disk, redis
        self.write_through_disk = write_through_disk and disk is not None
        self.fast_tiers: list[MemoryStore] = [t for t in (memory, host) if t is not None]
        self.slow_tiers: list[ChunkStore] = [t for t in (disk, redis) if t is not None]
        self.spills = disk is not None and not write_through_disk  # the disk gets what the fast tiers evict, not puts
        self._lock = threading.Lock()
        self._fast = threading.RLock()  # memory + host together: moves between them look atomic
        self._stats = TierStats(self.name)
        self._promotions: dict[str, int] = {}  # by the tier (or "queue": write-behind) a hit came from
        self.writer = WriteBehind(write_queue_bytes, flush_timeout_s, targets=_targets(
            getattr(disk, "directory", None), getattr(redis, "url", None))) if self.slow_tiers else None
        if host is not None:
            _chain_on_evict(memory, self._to_host)
        if self.spills:
            _chain_on_evict(self.fast_tiers[-1], self._spill)

    def tier_names(self) -> list[str]:
        """Where stored chunks live, fastest first, with their budgets: for the engine's plan."""
        names = [f"memory ({'device, ' if self.host is not None else ''}{self.memory.budget_bytes / 2**30:.2f} GiB)"]
        if self.host is not None:
            names.append(f"host ({self.host.budget_bytes / 2**30:.2f} GiB)")
        if self.disk is not None:
            names.append(f"disk ({getattr(self.disk, 'directory', '?')})")
        if self.redis is not None:
            names.append("redis")
        return names

    def watch(self, listener: Callable[[str, ChunkMeta | None, str], None] | None, device_medium: str) -> None:
        """Tell `listener` (None: stop) of every chunk stored in or removed from the fast tiers, with the tier's
        medium (`device_medium` for the memory tier, "CPU" for the host's): what this replica holds. The slow tiers
        (disk, a Redis shared between replicas) are not reported."""
        for tier, medium in ((self.memory, device_medium), (self.host, "CPU")):
            if tier is not None:
                tier.watch = None if listener is None else \
                    (lambda kind, meta, medium=medium: listener(kind, meta, medium))

    def _spill(self, record: ChunkRecord) -> None:
        self.writer.submit(record, [self.disk])  # (a dropped spill is counted by the queue)

    def _to_host(self, record: ChunkRecord) -> None:
        """The memory tier evicted `record`: it moves to the host (called under `_fast`: the memory tier's put)."""
        if not self.host.put(record) and self.spills:
            self._spill(record)  # larger than the host budget, or the move failed (counted): one tier down

    # ---- reads -----------------------------------------------------------------------------------
    def get(self, key: str) -> ChunkRecord | None:
        with self._fast:
            record = self.memory.get(key)
            if record is None and self.host is not None:
                record = self._from_host(key)
        if record is None and self.writer is not None:
            pending, record = self.writer.lookup(key)
            if pending:  # queued: served from the queue, or deleted (then the slow tiers' copy is stale)
                if record is not None:
                    self._store_fast(record)
                    self._promoted("queue")
                return self._counted(record)
        if record is None:
            for tier in self.slow_tiers:
                record = tier.get(key)
                if record is not None:
                    if self._store_fast(record):
                        self._promoted(tier.name)
                    break
        return self._counted(record)

    def _from_host(self, key: str) -> ChunkRecord | None:
        """The host's record of `key` (None: absent), moved back into memory when it fits. Under `_fast`."""
        got = self.host.fetch(key, copy_back_bytes=self.memory.budget_bytes)
        if got is None:
            return None
        host_record, device_record = got
        if device_record is None:  # larger than the memory budget, or no device memory for it now
            return host_record
        # Out of the host first, so the memory tier's evictions below cannot push out a copy that is leaving.
        self.host.delete(key)
        if self.memory.put(device_record):
            self._promoted(self.host.name)
            return device_record
        self.host.put(host_record)  # (not expected: it fit the memory budget) back where it was
        return host_record

    def _store_fast(self, record: ChunkRecord) -> bool:
        """`record` into the memory tier, or the host's where the key is or it exceeds the memory budget."""
        with self._fast:
            if self.host is not None and self.host.contains(record.key):
                return self.host.put(record)
            if self.memory.put(record):
                return True
            if self.host is None:
                return False
            codec = self.memory.codec
            return self.host.put(codec.decode(codec.encode(record)) if codec is not None else record)

    def _promoted(self, tier: str) -> None:
        with self._lock:
            self._promotions[tier] = self._promotions.get(tier, 0) + 1

    def _counted(self, record: ChunkRecord | None) -> ChunkRecord | None:
        with self._lock:
            if record is None:
                self._stats.misses += 1
            else:
                self._stats.hits += 1
        return record

    def contains(self, key: str) -> bool:
        with self._fast:
            if any(t.contains(key) for t in self.fast_tiers):
                return True
        if self.writer is not None:
            pending, record = self.writer.lookup(key)
            if pending:
                return record is not None
        return any(t.contains(key) for t in self.slow_tiers)

    def children(self, parent_key: str | None) -> list[ChunkMeta]:
        return self._merged(lambda t: t.children(parent_key))

    def by_content(self, content_key: str) -> list[ChunkMeta]:
        return self._merged(lambda t: t.by_content(content_key))

    def _merged(self, ask: Callable) -> list[ChunkMeta]:
        with self._fast:
            lists = [ask(t) for t in self.fast_tiers]
        deleted: set[str] = set()
        if self.writer is not None:
            lists.append(ask(self.writer))
            deleted = self.writer.deleted()
        lists += [[m for m in ask(t) if m.key not in deleted] for t in self.slow_tiers]
        seen: dict[str, ChunkMeta] = {}  # a union by key, the fastest tier's copy first (they describe one chunk)
        for metas in lists:
            for m in metas:
                seen.setdefault(m.key, m)
        return list(seen.values())

    # ---- writes ----------------------------------------------------------------------------------
    def put(self, record: ChunkRecord) -> bool:
        """Memory (or host) now; disk/Redis behind. True when a fast tier holds it or it is queued."""
        stored = self._store_fast(record)
        # The disk when not writing through only takes what is larger than the memory and host budgets: one tier down.
        slow = [t for t in self.slow_tiers if t is not self.disk or self.write_through_disk or not stored]
        if slow:
            stored = self.writer.submit(record, slow) or stored
        return stored

    def delete(self, key: str) -> None:
        with self._fast:
            for t in self.fast_tiers:
                t.delete(key)
        if self.writer is not None:
            self.writer.submit_delete(key, self.slow_tiers)

    def clear(self) -> None:
        """Forget everything, in every tier, now (an explicit request, so it waits for the slow tiers)."""
        with self._fast:
            for t in self.fast_tiers:
                t.clear()
        if self.writer is not None:
            self.writer.cancel_all()
        for t in self.slow_tiers:
            t.clear()

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every write queued for disk/Redis has landed; False if timeout_s passed first."""
        return self.writer.flush(timeout_s) if self.writer is not None else True

    def close(self, timeout_s: float | None = None) -> bool:
        """Flush (bounded: timeout_s, default the store's flush_timeout_s), then close the slow tiers."""
        done = self.writer.close(timeout_s) if self.writer is not None else True
        for t in self.slow_tiers:
            close = getattr(t, "close", None)
            if close is not None:
                close()
        return done

    # ---- stats -----------------------------------------------------------------------------------
    def tier_stats(self) -> dict[str, TierStats]:
        """Each tier's stats, with `promotions` and, for disk/Redis, the write-behind queue's counts."""
        out: dict[str, TierStats] = {}
        with self._lock:
            promotions = dict(self._promotions)
        for t in self.fast_tiers + self.slow_tiers:
            s = t.stats()
            s.promotions = promotions.get(t.name, 0)
            if t in self.slow_tiers and self.writer is not None:
                queue = self.writer.stats(t.name)
                # the queue's drops join the tier's own dropped_writes, so one dict gives every reason
                dropped = Counter(s.extra.get("dropped_writes", {})) + Counter(queue.pop("queue_dropped"))
                s.extra.update(queue, dropped_writes=dict(dropped))
            out[t.name] = s
        out["memory"].extra["queue_hits"] = promotions.get("queue", 0)
        return out

    def stats(self) -> TierStats:
        """Overall hits/misses (a hit in any tier is a hit), totals across tiers, per-tier stats in extra['tiers']."""
        per_tier = self.tier_stats()
        with self._lock:
            s = TierStats(**vars(self._stats))
        s.entries = sum(per_tier[t.name].entries for t in self.fast_tiers)  # (a key is in one of them)
        s.bytes = sum(t.bytes for t in per_tier.values())
        s.evictions = sum(t.evictions for t in per_tier.values())
        s.promotions = sum(t.promotions for t in per_tier.values())
        s.errors = sum(t.errors for t in per_tier.values())
        s.extra = {"tiers": {name: t.as_dict() for name, t in per_tier.items()}}
        return s


def _chain_on_evict(tier: MemoryStore, handler: Callable[[ChunkRecord], None]) -> None:
    """`handler` gets what `tier` evicts, before whatever hook the tier had already."""
    previous = tier.on_evict

    def evicted(record: ChunkRecord) -> None:
        handler(record)
        if previous is not None:
            previous(record)
    tier.on_evict = evicted


def _targets(directory: str | os.PathLike | None, redis_url: str | None) -> frozenset[str]:
    """Names for what a write-behind queue writes to, so stores sharing a target can be told apart."""
    out = set()
    if directory:
        out.add(f"disk:{os.path.realpath(os.path.expanduser(directory))}")
    if redis_url:
        out.add(f"redis:{redis_url}")
    return frozenset(out)


def build_store(config, namespace: str, write_through_disk: bool = True, device_budget_bytes: int | None = None,
                pin_host: bool = False) -> TieredStore:
    """The tiers an EngineConfig asks for; `namespace` must identify the model (and salt). device_budget_bytes: the
    memory tier is the device's, with a host tier of memory_budget_bytes behind it. A disk is written through."""
    # Another store in this process may still be writing to the same target: let it land first.
    flush_targets(_targets(config.disk_cache_dir, config.redis_url), config.flush_timeout_s)
    bits = config.kv_cache_bits
    # V groups span a token's [heads*head_dim] vector (up to 256): one scale/zero pair per token.
    codec = QuantCodec(bits, v_group_size=256) if bits < 16 else None
    budget = config.memory_budget_bytes
    host = None
    if device_budget_bytes is not None:
        if budget > 0:  # (none when the host budget is 0: the device tier alone, e.g. a draft model's chunks)
            host = HostStore(budget, pin=pin_host)
        budget = device_budget_bytes
    memory = MemoryStore(budget, max_entries=config.max_chunks, codec=codec)
    disk = None
    if config.disk_cache_dir:
        budget = config.disk_budget_bytes
        if budget is None:  # unbounded would eventually fill the disk
            budget = default_disk_budget(config.disk_cache_dir)
        disk = DiskStore(config.disk_cache_dir, budget, namespace=namespace, bits=bits)
    redis = RedisStore(config.redis_url, namespace=namespace, ttl_s=config.redis_ttl_s, bits=bits) \
        if config.redis_url else None
    return TieredStore(memory, disk=disk, redis=redis, write_through_disk=write_through_disk,
                       write_queue_bytes=config.write_queue_bytes, flush_timeout_s=config.flush_timeout_s, host=host)
