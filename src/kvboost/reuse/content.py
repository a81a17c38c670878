"""Find warmed content anywhere in a prompt, at token granularity: an index of stored chunks' token windows (polynomial
hash, salted per tenant) is scanned at every prompt offset; hits are verified and extended through chain children."""
from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import xxhash

from ..store.base import ChunkMeta
from .match import common_prefix_length

WINDOW = 16  # tokens per hashed window; shorter runs are not worth an approximation
MIN_MATCH = 16  # a content segment shorter than this is left to prefill
_MAX_CANDIDATES = 8  # per window hash: boilerplate windows repeat, we keep the most recent few
_BASE = np.uint64(0x100000001B3)  # FNV prime: odd, spreads token ids over all 64 bits


def window_hashes(token_ids: Sequence[int] | np.ndarray, window: int, salt: str | None = None) -> np.ndarray:
    """uint64 hash of every `window` ids (out[i] covers ids[i:i + window]), seeded per tenant."""
    ids = np.asarray(token_ids, dtype=np.int64).astype(np.uint64)
    n = ids.shape[0] - window + 1
    if n <= 0:
        return np.zeros(0, dtype=np.uint64)
    with np.errstate(over="ignore"):
        h = np.full(n, xxhash.xxh3_64_intdigest(("kvb-content|" + (salt or "")).encode()), dtype=np.uint64)
        for j in range(window):
            h = h * _BASE + ids[j:j + n] + np.uint64(1)  # +1: a run of id 0 must not hash like an empty one
    return h


@dataclass(frozen=True)
class Piece:
    """Tokens [offset, offset + n_tokens) of stored chunk `key`, placed at prompt positions [start, end); src_start
    (record.start + offset) is where the K/V was computed, so keys move by delta = start - src_start."""

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


class ContentIndex:
    """Window hash -> (chunk key, offset) for every chunk the engine stored in this process."""

    def __init__(self, window: int = WINDOW):
        self.window = window
        self._windows: dict[int, list[tuple[str, int]]] = {}
        self._metas: dict[str, ChunkMeta] = {}
        self._children: dict[str, list[str]] = {}
        self._salts: dict[str, str | None] = {}
        self._n_windows = 0  # entries in _windows
        self._stale_windows = 0  # entries of discarded chunks still in _windows (an upper bound)
        self._pruned_size = 0  # len(self) after the last prune(): decides when the next one is due
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
            self._salts[meta.key] = salt
            if meta.parent_key is not None:
                self._children.setdefault(meta.parent_key, []).append(meta.key)
            self._index_windows(meta, salt)

    def _index_windows(self, meta: ChunkMeta, salt: str | None) -> None:
        # A chunk shorter than a window gets no seeds: it is reached by extension from its parent.
        for offset, h in enumerate(window_hashes(meta.token_ids, self.window, salt).tolist()):
            bucket = self._windows.setdefault(h, [])
            bucket.append((meta.key, offset))
            self._n_windows += 1
            if len(bucket) > _MAX_CANDIDATES:
                del bucket[0]
                self._n_windows -= 1

    def discard(self, key: str) -> None:
        """Forget a chunk the store no longer holds."""
        with self._lock:
            meta = self._metas.pop(key, None)
            if meta is None:
                return
            self._salts.pop(key, None)
            siblings = self._children.get(meta.parent_key, [])  # (a root chunk's parent, None, has no entry)
            if key in siblings:
                siblings.remove(key)
            if not siblings:
                self._children.pop(meta.parent_key, None)
            self._stale_windows += max(0, len(meta.token_ids) - self.window + 1)
            if self._stale_windows > max(4096, self._n_windows // 2):
                self._rebuild_windows()

    def _rebuild_windows(self) -> None:
        self._windows.clear()
        self._n_windows = 0
        for key, meta in self._metas.items():
            self._index_windows(meta, self._salts.get(key))
        self._stale_windows = 0

    def prune_due(self) -> bool:
        """True when the index has doubled since the last prune (stores evict without telling us)."""
        return len(self._metas) > max(4096, 2 * self._pruned_size)

    def prune(self, contains: Callable[[str], bool]) -> int:
        """Discard every chunk the store no longer holds; returns how many. Amortized by prune_due()."""
        gone = [key for key in list(self._metas) if not contains(key)]
        for key in gone:
            self.discard(key)
        self._pruned_size = len(self._metas)
        return len(gone)

    def clear(self) -> None:
        with self._lock:
            for table in (self._windows, self._metas, self._children, self._salts):
                table.clear()
            self._n_windows = self._stale_windows = self._pruned_size = 0

    # ---- matching ----------------------------------------------------------------------------------
    def find(self, ids: Sequence[int], start: int, stop: int, salt: str | None = None,
             min_match: int = MIN_MATCH) -> list[ContentSegment]:
        """Non-overlapping stored-content segments of ids[start:stop], left to right, greedily the longest."""
        w = self.window
        if stop - start < max(w, min_match) or not self._metas:
            return []
        ids = [int(t) for t in ids]
        hashes = window_hashes(ids[:stop], w, salt).tolist()
        segments: list[ContentSegment] = []
        pos = floor = start  # floor: no segment may reach back before it (the previous one ends there)
        with self._lock:
            while pos + w <= stop:
                runs: list[list[Piece]] = []
                target = tuple(ids[pos:pos + w])
                for key, offset in self._windows.get(hashes[pos], ()):
                    meta = self._metas.get(key)
                    if meta is None or meta.token_ids[offset:offset + w] != target:
                        continue  # evicted chunk or a hash collision
                    # Windows never straddle chunks, so a run may start before its first seed: walk back, then forward.
                    begin, key, offset = self._extend_back(ids, pos, floor, key, offset)
                    runs.append(self._extend(ids, begin, stop, key, offset))
                # The longest run; of equal ones, the one moved least.
                best = max(runs, key=lambda r: (r[-1].end - r[0].start, -abs(r[0].delta)), default=None)
                if best is not None and best[-1].end - best[0].start >= min_match:
                    segments.append(ContentSegment(best))
                    pos = floor = best[-1].end
                else:
                    pos += 1
        return segments

    def _extend_back(self, ids: list[int], pos: int, floor: int, key: str, offset: int) -> tuple[int, str, int]:
        """Earliest (pos, key, offset) from which the stored content agrees with ids up to the seed."""
        while pos > floor:
            if offset == 0:
                parent = self._metas.get(self._metas[key].parent_key or "")
                if parent is None or parent.token_ids[-1] != ids[pos - 1]:
                    break
                key, offset = parent.key, len(parent.token_ids)
            elif self._metas[key].token_ids[offset - 1] != ids[pos - 1]:
                break
            pos, offset = pos - 1, offset - 1
        return pos, key, offset

    def _extend(self, ids: list[int], pos: int, stop: int, key: str, offset: int) -> list[Piece]:
        """Follow the stored content from (key, offset) while it equals ids[pos:stop], across chain children."""
        pieces: list[Piece] = []
        while True:
            meta = self._metas[key]
            toks = meta.token_ids
            n = common_prefix_length(toks[offset:], ids[pos:min(stop, pos + len(toks) - offset)])
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
                m = common_prefix_length(cmeta.token_ids, ids[pos:min(stop, pos + len(cmeta.token_ids))])
                if m > best_n:
                    nxt, best_n = child, m
            if nxt is None:
                break
            key, offset = nxt, 0
        return pieces
