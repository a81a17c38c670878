"""Memory -> disk -> Redis, behind the one ChunkStore interface the engine uses.

get() walks the tiers fastest first and promotes a lower-tier hit into memory, so the next request
for a hot chunk pays no deserialization. put() writes memory and, when Redis is configured, writes
through to it (Redis is the tier shared with other hosts, so it must learn new chunks right away).
The disk tier either receives what memory evicts, through the memory tier's on_evict hook (overflow
only: no disk write per put, but chunks still in memory are gone when the process exits), or, with
write_through_disk, every put (what other processes sharing the directory and the next run can see).
"""
from __future__ import annotations

import threading
from collections.abc import Callable

from .base import ChunkMeta, ChunkRecord, ChunkStore, TierStats
from .disk import DiskStore, default_disk_budget
from .memory import MemoryStore
from .quant import QuantCodec
from .redis import RedisStore


class TieredStore:
    name = "tiered"

    def __init__(self, memory: MemoryStore, disk: ChunkStore | None = None, redis: ChunkStore | None = None,
                 write_through_disk: bool = False):
        self.memory = memory
        self.disk = disk
        self.redis = redis
        self.write_through_disk = write_through_disk and disk is not None
        self._lock = threading.Lock()
        self._stats = TierStats(self.name)
        self._promotions: dict[str, int] = {}
        self._spill_failures = 0
        if disk is not None and not self.write_through_disk:
            self._chain_on_evict(memory.on_evict)

    @property
    def tiers(self) -> list[ChunkStore]:
        return [t for t in (self.memory, self.disk, self.redis) if t is not None]

    def _chain_on_evict(self, previous: Callable[[ChunkRecord], None] | None) -> None:
        def spill(record: ChunkRecord) -> None:
            if not self.disk.put(record):
                with self._lock:
                    self._spill_failures += 1
            if previous is not None:
                previous(record)
        self.memory.on_evict = spill

    # ---- reads -----------------------------------------------------------------------------------
    def get(self, key: str) -> ChunkRecord | None:
        record = self.memory.get(key)
        if record is None:
            for tier in (self.disk, self.redis):
                if tier is None:
                    continue
                record = tier.get(key)
                if record is not None:
                    if self.memory.put(record):
                        with self._lock:
                            self._promotions[tier.name] = self._promotions.get(tier.name, 0) + 1
                    break
        with self._lock:
            if record is None:
                self._stats.misses += 1
            else:
                self._stats.hits += 1
        return record

    def contains(self, key: str) -> bool:
        return any(t.contains(key) for t in self.tiers)

    def children(self, parent_key: str | None) -> list[ChunkMeta]:
        return _merge(t.children(parent_key) for t in self.tiers)

    def by_content(self, content_key: str) -> list[ChunkMeta]:
        return _merge(t.by_content(content_key) for t in self.tiers)

    # ---- writes ----------------------------------------------------------------------------------
    def put(self, record: ChunkRecord) -> bool:
        stored = self.memory.put(record)
        if self.disk is not None and (self.write_through_disk or not stored):
            # (when not writing through: larger than the whole memory budget, so keep it one tier down)
            stored = self.disk.put(record) or stored
        if self.redis is not None:
            stored = self.redis.put(record) or stored
        return stored

    def delete(self, key: str) -> None:
        for t in self.tiers:
            t.delete(key)

    def clear(self) -> None:
        for t in self.tiers:
            t.clear()

    def close(self) -> None:
        for t in (self.disk, self.redis):
            close = getattr(t, "close", None)
            if close is not None:
                close()

    # ---- stats -----------------------------------------------------------------------------------
    def tier_stats(self) -> dict[str, TierStats]:
        """Each tier's own stats, with `promotions` = hits that tier served which were promoted to memory."""
        out: dict[str, TierStats] = {}
        with self._lock:
            promotions = dict(self._promotions)
            spill_failures = self._spill_failures
        for t in self.tiers:
            s = t.stats()
            s.promotions = promotions.get(t.name, 0)
            if t is self.disk:
                s.extra["spill_failures"] = spill_failures
            out[t.name] = s
        return out

    def stats(self) -> TierStats:
        """Overall hits/misses (a hit in any tier is a hit), totals across tiers, per-tier stats in extra['tiers']."""
        per_tier = self.tier_stats()
        with self._lock:
            s = TierStats(**vars(self._stats))
        s.entries = per_tier["memory"].entries
        s.bytes = sum(t.bytes for t in per_tier.values())
        s.evictions = sum(t.evictions for t in per_tier.values())
        s.promotions = sum(t.promotions for t in per_tier.values())
        s.errors = sum(t.errors for t in per_tier.values())
        s.extra = {"tiers": {name: t.as_dict() for name, t in per_tier.items()}}
        return s


def _merge(lists) -> list[ChunkMeta]:
    """Union by key, the fastest tier's copy first (they describe the same chunk)."""
    seen: dict[str, ChunkMeta] = {}
    for metas in lists:
        for m in metas:
            seen.setdefault(m.key, m)
    return list(seen.values())


def build_store(config, namespace: str, write_through_disk: bool = True) -> TieredStore:
    """The tiers an EngineConfig asks for. `namespace` must identify the model (and salt) whose K/V these are.

    A configured disk directory is written through by default: a cache directory that only ever held
    memory's overflow would come back empty after a restart and share nothing between processes.
    """
    bits = config.kv_cache_bits
    # V groups span a token's whole [heads*head_dim] vector (up to 256 channels): one scale/zero pair per
    # token instead of several keeps int8 at <= 0.52x of fp16 bytes on small-head models like SmolLM2.
    codec = QuantCodec(bits, v_group_size=256) if bits < 16 else None
    memory = MemoryStore(config.memory_budget_bytes, max_entries=config.max_chunks, codec=codec)
    disk = None
    if config.disk_cache_dir:
        budget = config.disk_budget_bytes
        if budget is None:  # unbounded would eventually fill the disk
            budget = default_disk_budget(config.disk_cache_dir)
        disk = DiskStore(config.disk_cache_dir, budget, namespace=namespace, bits=bits)
    redis = None
    if config.redis_url:
        redis = RedisStore(config.redis_url, namespace=namespace, ttl_s=config.redis_ttl_s, bits=bits)
    return TieredStore(memory, disk=disk, redis=redis, write_through_disk=write_through_disk)
