"""Find warmed content anywhere in a prompt, at token granularity.

Exact reuse (reuse/match.py) only covers a prompt's prefix. A RAG prompt holds several warmed documents
in any order, after a system prompt and separators, so their tokens sit at arbitrary offsets. This module
keeps an index of every stored chunk's token windows (a polynomial hash over WINDOW consecutive ids, salted
per tenant) and scans the prompt with the same hash at every offset. A hit is only a candidate: it is
verified against the stored token ids, then extended token by token through the chunk and on into its
stored chain children, so a whole warmed document comes back as one segment even when its first token
tokenizes differently after a separator (the seed simply lands one token later).

The index is in-process and advisory: it may name chunks a store has since evicted or deleted. The engine
drops those when store.get() misses (ContentIndex.discard), and every token is re-checked against the
loaded record before its K/V is used, so a stale entry or a hash collision never produces wrong output.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import xxhash

from ..store.base import ChunkMeta

WINDOW = 16  # tokens per hashed window; shorter runs are not worth an approximation
MIN_MATCH = 16  # a content segment shorter than this is left to prefill
_MAX_CANDIDATES = 8  # per window hash: boilerplate windows repeat, we keep the most recent few
_BASE = np.uint64(0x100000001B3)  # FNV prime: odd, spreads token ids over all 64 bits


def _salt_seed(salt: str | None) -> np.uint64:
    return np.uint64(xxhash.xxh3_64_intdigest(("kvb-content|" + (salt or "")).encode()))


def window_hashes(token_ids: Sequence[int] | np.ndarray, window: int, salt: str | None = None) -> np.ndarray:
    """Hash of every run of `window` consecutive ids: out[i] covers ids[i:i + window]. uint64, wraps mod 2^64.

    Polynomial in the ids (sum of id * BASE^(window-1-j)) plus the tenant seed * BASE^window, so two tenants'
    identical documents never share an index entry. Vectorized: one pass per window offset, not per position.
    """
    ids = np.asarray(token_ids, dtype=np.int64).astype(np.uint64)
    n = ids.shape[0] - window + 1
    if n <= 0:
        return np.zeros(0, dtype=np.uint64)
    with np.errstate(over="ignore"):
        h = np.full(n, _salt_seed(salt), dtype=np.uint64)
        for j in range(window):
            h = h * _BASE + ids[j:j + n] + np.uint64(1)  # +1: a run of id 0 must not hash like an empty one
    return h


@dataclass(frozen=True)
class Piece:
    """Tokens [offset, offset + n_tokens) of stored chunk `key`, placed at prompt positions [start, end).

    src_start is the absolute position the stored K/V was computed at (record.start + offset), so the keys
    move by delta = start - src_start.
    """

    key: str
    offset: int
    n_tokens: int
    start: int
    src_start: int

    @property
    def end(self) -> int:
        return self.start + self.n_tokens

    @property
    def delta(self) -> int:
        return self.start - self.src_start


@dataclass
class ContentSegment:
    """Consecutive pieces of one stored chain: a seam (new, unseen preceding context) only at `start`."""

    pieces: list[Piece] = field(default_factory=list)

    @property
    def start(self) -> int:
        return self.pieces[0].start

    @property
    def end(self) -> int:
        return self.pieces[-1].end

    @property
    def n_tokens(self) -> int:
        return sum(p.n_tokens for p in self.pieces)


class ContentIndex:
    """Window hash -> (chunk key, offset) for every chunk the engine stored in this process."""

    def __init__(self, window: int = WINDOW, max_candidates: int = _MAX_CANDIDATES):
        self.window = window
        self.max_candidates = max_candidates
        self._windows: dict[int, list[tuple[str, int]]] = {}
        self._metas: dict[str, ChunkMeta] = {}
        self._children: dict[str, list[str]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._metas)

    def __contains__(self, key: str) -> bool:
        return key in self._metas

    def add(self, meta: ChunkMeta, salt: str | None = None) -> None:
        """Index a stored chunk (full or partial). Idempotent."""
        with self._lock:
            if meta.key in self._metas:
                return
            self._metas[meta.key] = meta
            if meta.parent_key is not None:
                self._children.setdefault(meta.parent_key, []).append(meta.key)
            hashes = window_hashes(meta.token_ids, min(self.window, len(meta.token_ids)), salt)
            if len(meta.token_ids) < self.window:
                # A short partial tail is found by extension from its parent; index its full run anyway so a
                # short warmed text is findable on its own when min_match allows it.
                hashes = hashes[:1]
            for offset, h in enumerate(hashes.tolist()):
                bucket = self._windows.setdefault(h, [])
                bucket.append((meta.key, offset))
                if len(bucket) > self.max_candidates:
                    del bucket[0]

    def discard(self, key: str) -> None:
        """Forget a chunk the store no longer holds (its window entries are skipped lazily)."""
        with self._lock:
            meta = self._metas.pop(key, None)
            if meta is not None and meta.parent_key is not None:
                siblings = self._children.get(meta.parent_key)
                if siblings and key in siblings:
                    siblings.remove(key)

    def clear(self) -> None:
        with self._lock:
            self._windows.clear()
            self._metas.clear()
            self._children.clear()

    # ---- matching ----------------------------------------------------------------------------------
    def find(self, ids: Sequence[int], start: int, stop: int, salt: str | None = None,
             min_match: int = MIN_MATCH) -> list[ContentSegment]:
        """Non-overlapping segments of ids[start:stop] whose tokens equal stored chunk content, left to right.

        Greedy: at each position take the candidate that extends furthest (ties: the smallest position shift),
        then continue after it. Positions in no segment are left for prefill.
        """
        ids = [int(t) for t in ids]
        w = self.window
        if stop - start < max(w, min_match) or not self._metas:
            return []
        hashes = window_hashes(ids[:stop], w, salt).tolist()
        segments: list[ContentSegment] = []
        pos = start
        with self._lock:
            while pos + w <= stop:
                best: list[Piece] | None = None
                best_score: tuple[int, int] | None = None
                target = tuple(ids[pos:pos + w])
                for key, offset in self._windows.get(hashes[pos], ()):
                    meta = self._metas.get(key)
                    if meta is None or meta.token_ids[offset:offset + w] != target:
                        continue  # evicted chunk or a hash collision
                    pieces = self._extend(ids, pos, stop, key, offset)
                    total = pieces[-1].end - pos
                    score = (total, -abs(pieces[0].delta))
                    if best_score is None or score > best_score:
                        best, best_score = pieces, score
                if best is not None and best_score[0] >= min_match:
                    segments.append(ContentSegment(best))
                    pos = best[-1].end
                else:
                    pos += 1
        return segments

    def _extend(self, ids: list[int], pos: int, stop: int, key: str, offset: int) -> list[Piece]:
        """Follow the stored content from (key, offset) while it equals ids[pos:stop], across chain children."""
        pieces: list[Piece] = []
        while True:
            meta = self._metas[key]
            toks = meta.token_ids
            n = 0
            limit = min(len(toks) - offset, stop - pos)
            while n < limit and toks[offset + n] == ids[pos + n]:
                n += 1
            if n == 0:
                break
            pieces.append(Piece(key, offset, n, pos, meta.start + offset))
            pos += n
            if offset + n < len(toks) or pos >= stop:
                break
            # The chunk is used up: continue into the stored child that agrees longest with what follows.
            nxt, best_n = None, 0
            for child in self._children.get(key, ()):
                cmeta = self._metas.get(child)
                if cmeta is None:
                    continue
                m = 0
                cap = min(len(cmeta.token_ids), stop - pos)
                while m < cap and cmeta.token_ids[m] == ids[pos + m]:
                    m += 1
                if m > best_n:
                    nxt, best_n = child, m
            if nxt is None:
                break
            key, offset = nxt, 0
        return pieces
