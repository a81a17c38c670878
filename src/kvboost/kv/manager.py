"""The KV-cache manager: what K/V a prompt can reuse, placing it into a workspace, storing new chunks.

Every request path goes through one manager per engine: lookup() -> Plan, place() into a workspace, the caller's prefill
and decode, write_back() of the new chunks, record(). It owns the chunk store (all tiers), the chunker and the content
index; it never runs the model.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from ..chunking import Chunker
from ..config import EngineConfig
from ..results import GenerationMode
from ..reuse.assemble import Assembly, ContentState, place_segments
from ..reuse.content import ContentSegment
from ..reuse.match import Segment, common_prefix_length, match_exact
from ..reuse.rope import RotaryInfo
from ..store.base import ChunkMeta, ChunkRecord, ChunkStore
from ..store.quant import LazyQuantRecord, QuantRun
from .workspace import KVWorkspace


class KVSource(Protocol):
    """Anything a sequence's K/V can be read back from for storing (a workspace, a batch row's prefixed view)."""

    def read(self, start: int, end: int, row: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]: ...


@dataclass
class Plan:
    """Where a prompt's K/V comes from: exact positions [0, reuse_len), of which [0, resident) are already in the
    workspace and the rest come from `segments`; content matches after reuse_len are placed re-positioned by place()."""

    n_prompt: int
    reuse_len: int = 0
    resident: int = 0
    segments: list[Segment] = field(default_factory=list)
    lookup_ms: float = 0.0
    content: list[ContentSegment] = field(default_factory=list)  # found, not yet placed
    rotary: list[RotaryInfo] | None = None
    content_fallback: str | None = None  # why content matches were found but not used
    assembly: Assembly | None = None  # set by place() when content was placed
    recomputed_tokens: int = 0  # set by the repair forward

    @property
    def approximate_tokens(self) -> int:
        return self.assembly.n_tokens if self.assembly is not None else 0

    @property
    def cached_tokens(self) -> int:
        return self.reuse_len + self.approximate_tokens

    @property
    def needs_repair(self) -> bool:
        return self.assembly is not None

    @property
    def has_content(self) -> bool:
        """Content matches were found that place() will put at their new positions."""
        return bool(self.content) and self.rotary is not None


@dataclass
class _Counters:
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    lookup_ms: float = 0.0
    chunks_written: int = 0
    by_mode: dict = field(default_factory=dict)


class KVCacheManager:
    def __init__(self, config: EngineConfig, namespace: str, chunker: Chunker, store: ChunkStore,
                 model: torch.nn.Module):
        self.config = config
        self.namespace = namespace
        self.chunker = chunker
        self.store = store
        self.content = ContentState(model)
        self._counters = _Counters()
        self._count_lock = threading.Lock()

    def tag(self, salt: str | None) -> str:
        """The label of a workspace's resident prefix: reusable only by the same namespace and tenant."""
        return self.namespace + "|" + (salt or "")

    # ---- lookup -----------------------------------------------------------------------------------
    def lookup(self, ids: Sequence[int], salt: str | None, mode: GenerationMode, approximate: bool = False,
               resident: Sequence[int] = (), skip_before: int = 0) -> Plan:
        """Decide where every position's K/V comes from; reads the store, writes nothing. resident: ids whose exact K/V
        already sits at the workspace's first positions. skip_before: positions below it come from the caller (a shared
        prefix). approximate: also find stored chunks elsewhere (CHUNK_KV_REUSE only)."""
        t0 = time.perf_counter()
        ids = list(ids)
        plan = Plan(len(ids))
        if mode is GenerationMode.BASELINE:
            plan.lookup_ms = (time.perf_counter() - t0) * 1e3
            return plan
        token_granular = mode is GenerationMode.CHUNK_KV_REUSE
        chunks = self.chunker.split(ids, salt)
        if skip_before:
            chunks = [c for c in chunks if c.start >= skip_before]
        matched = match_exact(self.store, chunks, token_granular)
        have = common_prefix_length(resident, ids) if resident else 0
        if not token_granular:
            # Whole chunks only: down to the last complete chunk end (cuts move with a boundary window).
            have = max((c.end for c in chunks if c.complete and c.end <= have), default=0)
        limit = len(ids) - 1  # the last prompt token always runs: its logits pick the first new token
        plan.reuse_len = min(max(skip_before, have, matched[-1].end if matched else 0), limit)
        plan.resident = min(have, plan.reuse_len)
        plan.segments = [s for s in matched if s.end > plan.resident and s.start < plan.reuse_len]
        if approximate and token_granular:
            # Sink tokens stay fresh: content is never placed before position sink_tokens.
            start = max(plan.reuse_len, self.config.sink_tokens)
            plan.content, plan.rotary, plan.content_fallback = self.content.find(self.store, ids, start, limit, salt)
        plan.lookup_ms = (time.perf_counter() - t0) * 1e3
        return plan

    # ---- place ------------------------------------------------------------------------------------
    def place(self, plan: Plan, workspace: KVWorkspace, ids: Sequence[int], row: int | None = None) -> None:
        """Copy the plan's stored K/V into `workspace` (every row, or one `row`), skipping resident positions. Content
        matches are re-positioned and re-verified; a piece whose record is gone is left for prefill."""
        t0 = time.perf_counter()
        for run in _runs(plan):
            for group in _staged_groups(run, workspace.device):
                _place_group(group, workspace, row)
        if plan.has_content:
            assert plan.rotary is not None
            plan.assembly, fallback = place_segments(workspace, self.store, self.content.index, list(ids),
                                                     plan.content, plan.rotary, row=row)
            plan.content_fallback = plan.content_fallback or fallback
        plan.lookup_ms += (time.perf_counter() - t0) * 1e3

    # ---- write-back --------------------------------------------------------------------------------
    def write_back(self, seq: Sequence[int], salt: str | None, source: KVSource, row: int = 0,
                   cut_ids: Sequence[int] | None = None) -> tuple[int, int]:
        """Store every chunk of seq not stored yet, read from `source` row `row`; returns (new, existing). cut_ids: a
        longer sequence starting with seq, whose cuts are used (only chunks ending within seq)."""
        seq = list(seq)
        new = existing = 0
        index = self.content.index  # every stored chunk is findable by content at other positions too
        for chunk in self.chunker.split(seq if cut_ids is None else cut_ids, salt, end=len(seq)):
            meta = ChunkMeta(chunk.prefix_key, chunk.parent_key, chunk.content_key, chunk.token_ids, chunk.start)
            if self.store.contains(chunk.prefix_key):
                existing += 1
                index.add(meta, salt)  # e.g. stored by a disk tier in an earlier process
                continue
            keys, values = source.read(chunk.start, chunk.end, row=row)
            record = ChunkRecord(chunk.prefix_key, chunk.parent_key, chunk.content_key, chunk.token_ids,
                                 chunk.start, keys, values)
            if self.store.put(record):
                new += 1
                index.add(meta, salt)
            if chunk.complete:
                self._drop_superseded(chunk.parent_key, chunk.token_ids)
        with self._count_lock:
            self._counters.chunks_written += new
        return new, existing

    def _drop_superseded(self, parent_key: str | None, token_ids: tuple[int, ...]) -> None:
        """Drop a partial sibling that a complete chunk extends. Under a boundary window only one shorter than any
        complete chunk (size - W), or childless, is a remainder."""
        n = len(token_ids)
        floor = self.config.chunk_size - self.config.chunk_boundary_window
        for meta in self.store.children(parent_key):
            m = len(meta.token_ids)
            if m < n and token_ids[:m] == meta.token_ids and (m < floor or not self.store.children(meta.key)):
                self.store.delete(meta.key)
                self.content.index.discard(meta.key)

    # ---- accounting ---------------------------------------------------------------------------------
    def record(self, mode: GenerationMode, n_prompt: int, plan: Plan) -> None:
        with self._count_lock:
            c = self._counters
            c.requests += 1
            c.prompt_tokens += n_prompt
            c.cached_tokens += plan.reuse_len
            c.lookup_ms += plan.lookup_ms
            c.by_mode[mode.value] = c.by_mode.get(mode.value, 0) + 1

    def stats(self) -> dict:
        c = self._counters
        per_tier = self.store.tier_stats() if hasattr(self.store, "tier_stats") else {"memory": self.store.stats()}
        return {
            "requests": c.requests, "prompt_tokens": c.prompt_tokens, "cached_tokens": c.cached_tokens,
            "reuse_ratio": c.cached_tokens / c.prompt_tokens if c.prompt_tokens else 0.0,
            "avg_lookup_ms": c.lookup_ms / c.requests if c.requests else 0.0,
            "chunks_written": c.chunks_written, "requests_by_mode": dict(c.by_mode),
            "tiers": {name: t.as_dict() for name, t in per_tier.items()},
            "content_index_chunks": len(self.content.index), "chunk_size": self.config.chunk_size,
            "namespace": self.namespace,
        }

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait (at most timeout_s, default config.flush_timeout_s) until queued disk / Redis writes land; False if the
        wait ran out."""
        return self.store.flush(self.config.flush_timeout_s if timeout_s is None else timeout_s)

    def close(self, timeout_s: float | None = None) -> bool:
        """Flush (bounded), then release the tiers; later writes are dropped and counted."""
        return self.store.close(timeout_s)

    def clear(self) -> None:
        """Forget every stored chunk (all tiers) and the content index."""
        self.store.clear()
        self.content.index.clear()


# ---- placing exact segments ---------------------------------------------------------------------------
# Consecutive chunks are placed as one run, per layer one concatenation (KVWorkspace.write_layer) and quantized chunks
# dequantized together (QuantRun): copying chunk by chunk is chunks x layers x 2 kernel launches.


@dataclass
class _Piece:
    """Tokens [offset, offset + n) of `record`, placed at positions [start, start + n)."""

    record: ChunkRecord
    offset: int
    n: int
    start: int


def _runs(plan: Plan) -> list[list[_Piece]]:
    """The plan's segments less the positions the workspace already holds (resident), as runs written together:
    consecutive positions, with every inner boundary between whole records, so a run's K/V is its records' tokens
    concatenated, trimmed at both ends."""
    runs: list[list[_Piece]] = []
    for seg in plan.segments:
        start = max(seg.start, plan.resident)
        n = min(seg.end, plan.reuse_len) - start
        if n <= 0:
            continue
        p = _Piece(seg.record, start - seg.start, n, start)
        prev = runs[-1][-1] if runs else None
        if prev is not None and prev.start + prev.n == start and prev.offset + prev.n == prev.record.n_tokens \
                and p.offset == 0:
            runs[-1].append(p)
        else:
            runs.append([p])
    return runs


# Host records bound for a GPU cross as their packed buffer, one copy per record, in groups of at most this many bytes
# (per-layer slices would be many small copies).
_STAGE_BYTES = 64 << 20


def _staged_groups(run: list[_Piece], device: torch.device):
    """Sub-runs of `run` (each still a run) whose packed host records were copied to `device`."""
    if device.type == "cpu":
        yield run
        return
    group: list[_Piece] = []
    staged = 0
    for p in run:
        packed = None if isinstance(p.record, LazyQuantRecord) else p.record.packed_view()
        if packed is not None and packed.device.type == "cpu":
            r = p.record
            p = replace(p, record=ChunkRecord.from_packed(r.key, r.parent_key, r.content_key, r.token_ids, r.start,
                                                          packed.to(device)))
            staged += packed.nbytes
        group.append(p)
        if staged >= _STAGE_BYTES:
            yield group
            group, staged = [], 0
    if group:
        yield group


def _place_group(run: list[_Piece], workspace: KVWorkspace, row: int | None) -> None:
    parts: list[ChunkRecord | QuantRun] = []  # consecutive quantized records are dequantized together
    for p in run:
        if not isinstance(p.record, LazyQuantRecord):
            parts.append(p.record)
        elif parts and isinstance(parts[-1], QuantRun):
            parts[-1].payloads.append(p.record.payload)
        else:
            parts.append(QuantRun([p.record.payload]))
    head = run[0].offset
    tail = run[-1].record.n_tokens - run[-1].offset - run[-1].n

    def place_layer(i: int) -> None:
        keys: list[torch.Tensor] = []  # layer i's K and V pieces [kv_heads, tokens, head_dim], every record's in order
        values: list[torch.Tensor] = []
        for part in parts:
            k, v = part.layer(i) if isinstance(part, QuantRun) else ([part.keys[i]], [part.values[i]])
            keys += k
            values += v
        workspace.write_layer(i, _trim(keys, head, tail), _trim(values, head, tail), run[0].start, row=row)

    layers = range(len(workspace.shapes))
    token_bytes = sum(s.kv_heads * (s.head_dim_k + s.head_dim_v) for s in workspace.shapes) * workspace.dtype.itemsize
    if workspace.device.type == "cpu" and torch.get_num_threads() > 1 \
            and sum(p.n for p in run) * token_bytes >= _POOL_BYTES:
        # A CPU concatenation of many chunks runs on one core; layers are independent buffers, so the copy of a long
        # run is spread over torch's threads (it is bandwidth-bound: two cores copy it in about half the time).
        inference = torch.is_inference_mode_enabled()  # grad modes are per thread: the workers take the caller's

        def place_layer_here(i: int) -> None:
            with torch.inference_mode(inference), torch.no_grad():
                place_layer(i)

        list(_copy_pool().map(place_layer_here, layers))
    else:
        for i in layers:
            place_layer(i)


# Runs below this many bytes are placed on the calling thread: a hand-off costs more than their copy.
_POOL_BYTES = 8 << 20
_pools: dict[int, ThreadPoolExecutor] = {}  # by worker count: torch's thread count can change at run time
_pools_lock = threading.Lock()


def _copy_pool() -> ThreadPoolExecutor:
    workers = torch.get_num_threads()
    with _pools_lock:
        if workers not in _pools:
            _pools[workers] = ThreadPoolExecutor(workers, thread_name_prefix="kvboost-place")
        return _pools[workers]


def _trim(pieces: list[torch.Tensor], head: int, tail: int) -> list[torch.Tensor]:
    """Drop `head` tokens from the first piece and `tail` from the last (they may be the same piece)."""
    if head:
        pieces = [pieces[0][:, head:], *pieces[1:]]
    if tail:
        pieces = [*pieces[:-1], pieces[-1][:, :pieces[-1].shape[1] - tail]]
    return pieces
