"""Find which of a prompt's tokens already have exact K/V in the store.

Exact reuse walks the prefix chain chunk by chunk. Where the chain breaks (a miss, or the prompt's
last, partial chunk) matching goes on at token granularity among the stored children of the last
matched chunk: a chat history whose re-tokenized reply differs from the generated ids in one token
loses only the tokens from that point on, not the whole chunk.
"""
from __future__ import annotations

from dataclasses import dataclass, field

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


@dataclass
class ExactMatch:
    segments: list[Segment] = field(default_factory=list)
    chunks_probed: int = 0

    @property
    def length(self) -> int:
        return self.segments[-1].end if self.segments else 0


def common_prefix_length(a, b) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def match_exact(store: ChunkStore, chunks: list[Chunk], chunk_size: int, token_granular: bool = True) -> ExactMatch:
    match = ExactMatch()
    for chunk in chunks:
        match.chunks_probed += 1
        if len(chunk.token_ids) == chunk_size:
            record = store.get(chunk.prefix_key)
            # A key hit counts only once the stored ids equal the prompt's: a hash collision must never
            # put someone else's K/V under this prompt.
            if record is not None and record.token_ids == chunk.token_ids and record.start == chunk.start:
                match.segments.append(Segment(record, chunk.start, chunk_size))
                continue
        if token_granular:
            partial = _best_partial(store, chunk)
            if partial is not None:
                match.segments.append(partial)
        break
    return match


def _best_partial(store: ChunkStore, chunk: Chunk) -> Segment | None:
    best: tuple[int, ChunkMeta] | None = None
    for meta in store.children(chunk.parent_key):
        if meta.start != chunk.start:
            continue
        n = common_prefix_length(meta.token_ids, chunk.token_ids)
        if n > 0 and (best is None or n > best[0]):
            best = (n, meta)
    if best is None:
        return None
    n, meta = best
    record = store.get(meta.key)
    if record is None or record.token_ids[:n] != chunk.token_ids[:n]:
        return None
    return Segment(record, chunk.start, n)
