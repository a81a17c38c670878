"""Find which of a prompt's tokens already have exact K/V in the store: the prefix chain chunk by chunk, then at token
granularity among the last matched chunk's stored children (chunk lengths vary with a boundary window)."""
from __future__ import annotations

from dataclasses import dataclass

from ..chunking import Chunk
from ..store.base import ChunkMeta, ChunkRecord, ChunkStore


@dataclass
class Segment:
    """`n_tokens` leading tokens of `record`, placed at prompt positions [start, start + n_tokens)."""

    record: ChunkRecord
    start: int
    n_tokens: int

    @property
    def end(self) -> int:
        return self.start + self.n_tokens


def common_prefix_length(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def match_exact(store: ChunkStore, chunks: list[Chunk], token_granular: bool = True) -> list[Segment]:
    """Longest run of stored exact K/V from chunks[0] on; the first miss (or trailing incomplete chunk) is matched at
    token granularity when token_granular."""
    segments: list[Segment] = []
    for i, chunk in enumerate(chunks):
        if chunk.complete:
            record = store.get(chunk.prefix_key)
            # A key hit counts only once the stored ids equal the prompt's (a hash collision must not).
            if record is not None and record.token_ids == chunk.token_ids and record.start == chunk.start:
                segments.append(Segment(record, chunk.start, len(chunk.token_ids)))
                continue
        if token_granular:
            partial = _best_partial(store, chunks, i)
            if partial is not None:
                segments.append(partial)
        break
    return segments


def _best_partial(store: ChunkStore, chunks: list[Chunk], i: int) -> Segment | None:
    """The stored sibling of chunks[i] (same parent and start) that agrees longest with the prompt from there, compared
    with the following chunks' tokens too: with a boundary window a stored remainder may pass this prompt's cut."""
    chunk = chunks[i]
    tail, j = chunk.token_ids, i + 1
    best: tuple[int, ChunkMeta] | None = None
    for meta in store.children(chunk.parent_key):
        if meta.start != chunk.start:
            continue
        while len(tail) < len(meta.token_ids) and j < len(chunks):
            tail, j = tail + chunks[j].token_ids, j + 1
        n = common_prefix_length(meta.token_ids, tail)
        if n > 0 and (best is None or n > best[0]):
            best = (n, meta)
    if best is None:
        return None
    n, meta = best
    record = store.get(meta.key)
    return None if record is None or record.token_ids[:n] != tail[:n] else Segment(record, chunk.start, n)
