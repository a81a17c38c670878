"""Content index: warmed chunks are found at any token offset, verified by ids, and extended across chunks."""
from __future__ import annotations

import random

import numpy as np

from kvboost.chunking import Chunker
from kvboost.reuse.content import ContentIndex, window_hashes
from kvboost.store.base import ChunkMeta

CHUNK = 16


def _doc(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 5000) for _ in range(n)]


def _index(*docs: list[int], salt: str | None = None, window: int = 8) -> ContentIndex:
    """Index docs the way warm() stores them: a prefix chain from position 0, partial tail included."""
    chunker = Chunker(CHUNK, "test-ns")
    index = ContentIndex(window=window)
    for doc in docs:
        for c in chunker.split(doc, salt):
            index.add(ChunkMeta(c.prefix_key, c.parent_key, c.content_key, c.token_ids, c.start), salt)
    return index


def _covered(segments) -> list[tuple[int, int]]:
    return [(s.start, s.end) for s in segments]


def test_window_hashes_match_a_naive_polynomial_and_depend_on_salt():
    ids = _doc(0, 40)
    h = window_hashes(ids, 8)
    assert h.shape == (33,) and h.dtype == np.uint64
    # Equal windows hash alike wherever they occur; different windows (almost surely) do not.
    repeated = ids[:8] + [7, 7] + ids[:8]
    hr = window_hashes(repeated, 8)
    assert hr[0] == hr[10] == h[0]
    assert len(set(h.tolist())) == len(h)
    assert window_hashes(ids, 8, salt="tenant-a")[0] != h[0]
    assert window_hashes(ids[:5], 8).shape == (0,)


def test_finds_documents_at_arbitrary_offsets_with_source_positions():
    a, b = _doc(1, 45), _doc(2, 38)  # 2 full chunks + partial, 2 full + partial
    index = _index(a, b)
    prompt = [1, 2, 3] + b + [9, 9, 9, 9, 9] + a + [4, 5]
    segs = index.find(prompt, 0, len(prompt) - 1)
    assert _covered(segs) == [(3, 3 + len(b)), (46, 46 + len(a))]
    # Pieces follow the stored chain: each knows where its K/V was computed.
    for seg, doc, start in ((segs[0], b, 3), (segs[1], a, 46)):
        assert [p.src_start for p in seg.pieces] == list(range(0, len(doc), CHUNK))
        assert all(p.delta == start for p in seg.pieces)
        assert sum(p.n_tokens for p in seg.pieces) == len(doc)  # the partial tail is included


def test_first_token_that_tokenizes_differently_costs_one_token_only():
    a = _doc(3, 40)
    index = _index(a)
    prompt = [11, 12] + [999] + a[1:] + [5]  # the document's first token differs after a separator
    segs = index.find(prompt, 0, len(prompt) - 1)
    assert _covered(segs) == [(3, 3 + len(a) - 1)]
    assert segs[0].pieces[0].offset == 1 and segs[0].pieces[0].src_start == 1


def test_mismatch_inside_a_document_splits_the_match():
    a = _doc(4, 64)
    index = _index(a)
    edited = list(a)
    edited[30] = 77
    prompt = [1] + edited + [2]
    segs = index.find(prompt, 0, len(prompt) - 1)
    assert _covered(segs) == [(1, 31), (32, 65)]
    assert segs[1].pieces[0].src_start == 31


def test_respects_start_stop_and_min_match():
    a = _doc(5, 40)
    index = _index(a)
    prompt = a + [3]
    assert _covered(index.find(prompt, 0, len(prompt) - 1)) == [(0, 40)]
    assert _covered(index.find(prompt, 10, 30)) == [(10, 30)]
    assert index.find(prompt, 0, 12, min_match=16) == []


def test_salt_isolates_tenants_and_discard_forgets_chunks():
    a = _doc(6, 40)
    index = _index(a, salt="tenant-a")
    prompt = [1] + a + [2]
    assert index.find(prompt, 0, len(prompt) - 1, salt="tenant-b") == []
    segs = index.find(prompt, 0, len(prompt) - 1, salt="tenant-a")
    assert _covered(segs) == [(1, 41)]
    for key in {p.key for p in segs[0].pieces}:
        index.discard(key)
    assert index.find(prompt, 0, len(prompt) - 1, salt="tenant-a") == []


def test_hash_collision_is_rejected_by_token_verification():
    a, other = _doc(7, 32), _doc(8, 32)
    index = _index(a)
    prompt = [1] + other + [2]
    # Forge a collision: make the prompt's first window hash point at a chunk with different tokens.
    h = int(window_hashes(prompt, index.window)[1])
    some_key = next(iter(index._metas))
    index._windows[h] = [(some_key, 0)]
    assert index.find(prompt, 0, len(prompt) - 1) == []


def test_prefers_the_longest_candidate():
    shared = _doc(9, 20)
    short = shared + _doc(10, 5)
    long = shared + _doc(11, 30)
    index = _index(short, long)
    prompt = [1] + long + [2]
    segs = index.find(prompt, 0, len(prompt) - 1)
    assert _covered(segs) == [(1, 1 + len(long))]


def test_prune_drops_chunks_the_store_lost_and_windows_are_rebuilt():
    docs = [_doc(20 + i, 40) for i in range(6)]
    index = _index(*docs)
    keep = {k for k, m in index._metas.items() if m.start == 0}  # the store kept first chunks only
    before = len(index)
    assert index.prune(keep.__contains__) == before - len(keep)
    assert set(index._metas) == keep and not index.prune_due()
    index._rebuild_windows()
    assert all(key in keep for bucket in index._windows.values() for key, _ in bucket)
    prompt = [1] + docs[2] + [2]
    assert _covered(index.find(prompt, 0, len(prompt) - 1)) == [(1, 1 + CHUNK)]
