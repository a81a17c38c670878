"""The unit of storage (one chunk's K/V for every layer) and the protocol every tier implements."""
from __future__ import annotations

import dataclasses
import logging
import threading
from dataclasses import dataclass, field, fields
from typing import Protocol, runtime_checkable

import torch

log = logging.getLogger("kvboost.store")


@dataclass(eq=False)
class Span:
    """Consecutive positions' K/V written together: layer i's [kv_heads, n, head_dim] from position `start`. The records
    of one write-back are views of it, so a run of them is one tensor per layer, read where it lies."""

    start: int
    keys: list[torch.Tensor]
    values: list[torch.Tensor]


@dataclass
class ChunkRecord:
    """One chunk's K/V, computed in full context at positions [start, start + len(token_ids)). keys[i] / values[i]:
    layer i's [kv_heads, n_tokens, head_dim]; packed: one [layers, 2, kv_heads, n_tokens, head_dim] tensor they view;
    span: the Span they view instead (at its positions [start, start + n_tokens))."""

    key: str
    parent_key: str | None
    content_key: str
    token_ids: tuple[int, ...]
    start: int
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    packed: torch.Tensor | None = None
    span: Span | None = None

    @classmethod
    def of(cls, m: ChunkMeta, keys: list[torch.Tensor], values: list[torch.Tensor],
           packed: torch.Tensor | None = None, span: Span | None = None) -> ChunkRecord:
        return cls(m.key, m.parent_key, m.content_key, m.token_ids, m.start, keys, values, packed, span)

    @classmethod
    def from_packed(cls, meta: ChunkMeta, packed: torch.Tensor) -> ChunkRecord:
        """A record over packed [layers, 2, kv_heads, n_tokens, head_dim]; its keys / values are views of it."""
        if packed.dim() != 5 or packed.shape[1] != 2 or packed.shape[3] != len(meta.token_ids):
            raise ValueError(f"packed K/V {tuple(packed.shape)} is not [layers, 2, heads, {len(meta.token_ids)}, dim]")
        return cls.of(meta, list(packed[:, 0].unbind(0)), list(packed[:, 1].unbind(0)), packed)

    def packed_view(self) -> torch.Tensor | None:
        """`packed` while keys / values are still its views, else None."""
        p = self.packed
        if p is None or len(self.keys) != p.shape[0] or len(self.values) != p.shape[0]:
            return None
        base, size, shape, strides = p.data_ptr(), p.element_size(), p.shape[2:], p.stride()[2:]
        step, half = p.stride(0) * size, p.stride(1) * size
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            if (k.data_ptr() != base + i * step or v.data_ptr() != base + i * step + half or k.shape != shape
                    or v.shape != shape or k.stride() != strides or v.stride() != strides):
                return None
        return p

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.keys) + sum(t.nbytes for t in self.values)

    def meta(self) -> ChunkMeta:
        return ChunkMeta(self.key, self.parent_key, self.content_key, self.token_ids, self.start)

    def stacked(self) -> torch.Tensor | None:
        """This record as one [layers, 2, kv_heads, n, d] tensor (its packed one, else a new one); None when layers
        differ."""
        packed = self.packed_view()
        if packed is not None:
            return packed
        tensors = self.keys + self.values
        if not tensors or any(t.shape != tensors[0].shape or t.dtype != tensors[0].dtype or t.dim() != 3
                              or t.device != tensors[0].device for t in tensors):
            return None
        return torch.stack([torch.stack(self.keys), torch.stack(self.values)], dim=1)

    def standalone(self) -> ChunkRecord:
        """This record in memory of its own, no longer a view of its span."""
        packed = self.stacked()
        if packed is None:
            return dataclasses.replace(self, keys=[k.clone() for k in self.keys],
                                       values=[v.clone() for v in self.values], packed=None, span=None)
        return ChunkRecord.from_packed(self.meta(), packed)


@dataclass(frozen=True)
class ChunkMeta:
    """What a lookup needs before deciding to load K/V."""

    key: str
    parent_key: str | None
    content_key: str
    token_ids: tuple[int, ...]
    start: int


@dataclass
class TierStats:
    name: str
    entries: int = 0
    bytes: int = 0
    budget_bytes: int | None = None
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    promotions: int = 0
    errors: int = 0
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("name", "extra")}
        d.update(self.extra)
        return d


class TierHealth:
    """How a tier degraded: events and dropped writes counted by reason, each reason logged once at WARNING."""

    def __init__(self, tier: str):
        self.tier = tier
        self.log = log.getChild(tier)
        self._lock = threading.Lock()
        self._events: dict[str, int] = {}
        self._dropped: dict[str, int] = {}

    def event(self, reason: str, detail: str = "", n: int = 1) -> None:
        self._add(self._events, reason, n, f"{reason}: {detail}" if detail else reason)

    def dropped(self, reason: str, detail: str = "", n: int = 1) -> None:
        """A write (put or delete) that did not reach this tier."""
        self._add(self._dropped, reason, n, f"writes dropped ({reason})" + (f": {detail}" if detail else ""))

    def _add(self, table: dict[str, int], reason: str, n: int, message: str) -> None:
        with self._lock:
            first = reason not in table
            table[reason] = table.get(reason, 0) + n
        if first:
            self.log.warning("kvboost %s tier: %s (logged once; counted in cache_stats()['tiers'][%r])",
                             self.tier, message, self.tier)

    def as_extra(self) -> dict:
        with self._lock:
            return {"events": dict(self._events), "dropped_writes": dict(self._dropped)}


class CountedTier:
    """Hit/miss/error counts for tiers that can fail; subclasses give _get, _lock, _stats, _counters, health."""

    def get(self, key: str) -> ChunkRecord | None:
        try:
            record = self._get(key)
        except Exception:
            self._count("errors")
            record = None
        self._count("hits" if record is not None else "misses")
        return record

    def _snapshot(self) -> TierStats:
        """A copy of the stats, with the counters and the health's events and dropped writes in extra."""
        with self._lock:
            s = dataclasses.replace(self._stats, extra=dict(self._counters))
        s.extra.update(self.health.as_extra())
        return s

    def _count(self, field: str, n: int = 1) -> None:
        with self._lock:
            if field in self._counters:
                self._counters[field] += n
            else:
                setattr(self._stats, field, getattr(self._stats, field) + n)


@runtime_checkable
class ChunkStore(Protocol):
    """A tier. get() returns full-precision K/V or None; a failing backend counts an error and behaves as a miss."""

    name: str

    def get(self, key: str) -> ChunkRecord | None: ...

    def put(self, record: ChunkRecord) -> bool: ...

    def contains(self, key: str) -> bool: ...

    def children(self, parent_key: str | None) -> list[ChunkMeta]: ...

    def by_content(self, content_key: str) -> list[ChunkMeta]: ...

    def delete(self, key: str) -> None: ...

    def clear(self) -> None: ...

    def stats(self) -> TierStats: ...


def discard_member(index: dict, k, key: str) -> None:
    """Remove `key` from the set index[k], dropping the set once empty."""
    members = index.get(k)
    if members is not None:
        members.discard(key)
        if not members:
            del index[k]
