"""The KV-cache manager: what K/V a prompt can reuse, placing it into a workspace, storing new chunks.

Every request path goes through one manager per engine: lookup() -> Plan, place() into a workspace, the caller's prefill
and decode, write_back() of the new chunks, record(). It owns the chunk store (all tiers), the chunker and the content
index; it never runs the model.
"""
from __future__ import annotations

import functools
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from ..chunking import Chunk, Chunker
from ..config import EngineConfig
from ..results import GenerationMode
from ..reuse.assemble import Assembly, ContentState, place_segments
from ..reuse.content import ContentSegment
from ..reuse.match import Segment, common_prefix_length, match_exact
from ..reuse.rope import RotaryInfo
from ..store.base import ChunkRecord, ChunkStore, Span
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
        # On a CPU the chunks of one write-back view one Span, which a later prompt's prefill reads in place
        # (span_prefix); elsewhere each chunk is copied out on its own (placement copies are cheap there).
        self.spans = next(model.parameters()).device.type == "cpu"
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
    def place(self, plan: Plan, workspace: KVWorkspace, ids: Sequence[int], row: int | None = None,
              skip_below: int = 0) -> None:
        """Copy the plan's stored K/V into `workspace` (every row, or one `row`), skipping resident positions and those
        below skip_below (read in place: span_prefix). Content matches are re-positioned and re-verified; a piece whose
        record is gone is left for prefill."""
        t0 = time.perf_counter()
        self.place_exact(plan, workspace, row, skip_below)
        if plan.has_content:
            assert plan.rotary is not None
            plan.assembly, fallback = place_segments(workspace, self.store, self.content.index, list(ids),
                                                     plan.content, plan.rotary, row=row)
            plan.content_fallback = plan.content_fallback or fallback
        plan.lookup_ms += (time.perf_counter() - t0) * 1e3

    @staticmethod
    def place_exact(plan: Plan, workspace: KVWorkspace, row: int | None, first: int = 0,
                    stop: int | None = None) -> None:
        """Copy the plan's stored exact K/V of positions [first, stop) into `workspace`, less what it holds resident."""
        for run in _runs(plan, first, stop):
            for group in _staged_groups(run, workspace.device):
                _place_group(group, workspace, row)

    # ---- write-back --------------------------------------------------------------------------------
    def write_back(self, seq: Sequence[int], salt: str | None, source: KVSource, row: int = 0,
                   cut_ids: Sequence[int] | None = None) -> tuple[int, int]:
        """Store every chunk of seq not stored yet, read from `source` row `row`; returns (new, existing). cut_ids: a
        longer sequence starting with seq, whose cuts are used (only chunks ending within seq)."""
        seq = list(seq)
        existing = 0
        index = self.content.index  # every stored chunk is findable by content at other positions too
        todo: list[Chunk] = []
        for chunk in self.chunker.split(seq if cut_ids is None else cut_ids, salt, end=len(seq)):
            if self.store.contains(chunk.prefix_key):
                existing += 1
                index.add(chunk.meta(), salt)  # e.g. stored by a disk tier in an earlier process
            else:
                todo.append(chunk)
        new = 0
        for chunk, keys, values, span in _read_chunks(source, todo, row, self.spans):
            record = ChunkRecord.of(chunk.meta(), keys, values, span=span)
            if self.store.put(record):
                new += 1
                index.add(chunk.meta(), salt)
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


def span_prefix(plan: Plan) -> tuple[Span, int] | None:
    """(span, n): the plan's exact reuse of positions [0, n) lies in one stored span, as its first n positions, readable
    in place; None when the workspace holds some of it or its first chunk views no span."""
    if plan.resident or not plan.segments or plan.segments[0].start:
        return None
    span, n = plan.segments[0].record.span, 0
    if span is None or span.start:
        return None
    for seg in plan.segments:
        if seg.record.span is not span or seg.start != n or seg.record.start != n:
            break
        n = seg.end
    n = min(n, plan.reuse_len)
    return (span, n) if n else None


def _read_chunks(source: KVSource, chunks: list[Chunk], row: int, spans: bool):
    """(chunk, keys, values, span) for each chunk, read from source: with `spans`, consecutive complete chunks as views
    of one read (their Span); a remainder alone (a complete chunk that extends it later replaces it)."""
    i = 0
    while i < len(chunks):
        j = i + 1
        while spans and j < len(chunks) and chunks[j].complete and chunks[j - 1].complete \
                and chunks[j].start == chunks[j - 1].end:
            j += 1
        first, last = chunks[i], chunks[j - 1]
        keys, values = source.read(first.start, last.end, row=row)
        span = Span(first.start, keys, values) if j - i > 1 else None
        for chunk in chunks[i:j]:
            a, b = chunk.start - first.start, chunk.end - first.start
            yield chunk, [k[:, a:b] for k in keys], [v[:, a:b] for v in values], span
        i = j


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


def _runs(plan: Plan, first: int = 0, stop: int | None = None) -> list[list[_Piece]]:
    """The plan's segments within positions [first, stop) less those the workspace already holds (resident), as runs
    written together: consecutive positions, with every inner boundary between whole records, so a run's K/V is its
    records' tokens concatenated, trimmed at both ends."""
    runs: list[list[_Piece]] = []
    end = plan.reuse_len if stop is None else min(stop, plan.reuse_len)
    for seg in plan.segments:
        start = max(seg.start, plan.resident, first)
        n = min(seg.end, end) - start
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
            p = replace(p, record=ChunkRecord.from_packed(p.record.meta(), packed.to(device)))
            staged += packed.nbytes
        group.append(p)
        if staged >= _STAGE_BYTES:
            yield group
            group, staged = [], 0
    if group:
        yield group


@dataclass
class _SpanSlice:
    """Positions [start, end) of a span: consecutive records of one write-back, placed as one slice of it."""

    span: Span
    start: int
    end: int

    def layer(self, i: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        a, b = self.start - self.span.start, self.end - self.span.start
        return [self.span.keys[i][:, a:b]], [self.span.values[i][:, a:b]]


def _place_group(run: list[_Piece], workspace: KVWorkspace, row: int | None) -> None:
    # Consecutive quantized records are dequantized together; consecutive records of one span are one slice of it.
    parts: list[ChunkRecord | QuantRun | _SpanSlice] = []
    for p in run:
        r, last = p.record, parts[-1] if parts else None
        if isinstance(r, LazyQuantRecord):
            if isinstance(last, QuantRun):
                last.payloads.append(r.payload)
            else:
                parts.append(QuantRun([r.payload]))
        elif r.span is None:
            parts.append(r)
        elif isinstance(last, _SpanSlice) and last.span is r.span and last.end == r.start:
            last.end = r.start + r.n_tokens
        else:
            parts.append(_SpanSlice(r.span, r.start, r.start + r.n_tokens))
    head = run[0].offset
    tail = run[-1].record.n_tokens - run[-1].offset - run[-1].n

    def place_layer(i: int) -> None:
        keys: list[torch.Tensor] = []  # layer i's K and V pieces [kv_heads, tokens, head_dim], every record's in order
        values: list[torch.Tensor] = []
        for part in parts:
            k, v = ([part.keys[i]], [part.values[i]]) if isinstance(part, ChunkRecord) else part.layer(i)
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

        list(_copy_pool(torch.get_num_threads()).map(place_layer_here, layers))
    else:
        for i in layers:
            place_layer(i)


# Runs below this many bytes are placed on the calling thread: a hand-off costs more than their copy.
_POOL_BYTES = 8 << 20


@functools.cache  # by worker count: torch's thread count can change at run time
def _copy_pool(workers: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(workers, thread_name_prefix="kvboost-place")


def _trim(pieces: list[torch.Tensor], head: int, tail: int) -> list[torch.Tensor]:
    """Drop `head` tokens from the first piece and `tail` from the last (they may be the same piece)."""
    if head:
        pieces = [pieces[0][:, head:], *pieces[1:]]
    if tail:
        pieces = [*pieces[:-1], pieces[-1][:, :pieces[-1].shape[1] - tail]]
    return pieces
