from __future__ import annotations

import random

import numpy as np
import pytest
import xxhash

from kvboost.chunking import BOUNDARY_END, BOUNDARY_WORD, Chunker, boundary_classes, make_namespace, model_fingerprint

from .prompts import words
from .tiny_models import make_tiny_model


def test_split_full_and_partial_chunks():
    chunker = Chunker(4, "ns")
    chunks = chunker.split(list(range(10)))
    assert [c.token_ids for c in chunks] == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9)]
    assert [c.start for c in chunks] == [0, 4, 8]
    assert chunks[0].parent_key == chunker.root_key() and chunks[1].parent_key == chunks[0].prefix_key
    assert len(chunker.split(list(range(10)), include_partial=False)) == 2


def test_prefix_key_depends_on_everything_before():
    chunker = Chunker(4, "ns")
    a = chunker.split([1, 2, 3, 4, 5, 6, 7, 8])
    b = chunker.split([9, 2, 3, 4, 5, 6, 7, 8])
    assert a[1].token_ids == b[1].token_ids
    assert a[1].prefix_key != b[1].prefix_key
    assert a[1].content_key == b[1].content_key


def test_namespace_and_salt_separate_keys():
    ids = list(range(8))
    assert Chunker(4, "a").split(ids)[0].prefix_key != Chunker(4, "b").split(ids)[0].prefix_key
    c = Chunker(4, "a")
    assert c.split(ids, salt="t1")[0].prefix_key != c.split(ids, salt="t2")[0].prefix_key
    assert c.split(ids, salt="t1")[0].content_key != c.split(ids, salt="t2")[0].content_key
    assert c.split(ids)[0].prefix_key == Chunker(4, "a").split(ids)[0].prefix_key  # deterministic
    assert len({c.root_key("t1"), c.root_key("t2"), Chunker(4, "b").root_key("t1")}) == 3


def test_fingerprint_differs_between_weights(tokenizer):
    a = model_fingerprint(make_tiny_model("llama", tokenizer, seed=0))
    b = model_fingerprint(make_tiny_model("llama", tokenizer, seed=1))
    c = model_fingerprint(make_tiny_model("qwen2", tokenizer, seed=0))
    assert a == model_fingerprint(make_tiny_model("llama", tokenizer, seed=0))
    assert len({a, b, c}) == 3
    import torch
    assert make_namespace(a, torch.float32, 128, 16) != make_namespace(a, torch.float32, 128, 8)


# ---- W = 0: byte-identical to the fixed-size chunker ------------------------------------------------------
# Keys computed with the code before the boundary window existed (Chunker(16, NS).split(_OLD_IDS, salt)).
_NS = "kvb1|fp|float32|c16|w0|b16"
_OLD_IDS = [(i * 7919) % 5000 for i in range(70)]
_OLD_KEYS = {
    None: [(0, 16, "291f823a6e6e5665fe44c7c60f77a972", "2cc234d19371fbb90113a18e8a8bd30b"),
           (16, 16, "c7161923d86eaed228a919f9808306a4", "1029bc86c00a1a59f31b5186d4bc3719"),
           (32, 16, "899a25e14d0cbd13d42510d8f869fb56", "6acfbad9b3b9b061b14b40bd041ea7c6"),
           (48, 16, "f70ab6de900af763af79c55cf442545d", "68925b1dbf41246a956ae8f3cbaa36ba"),
           (64, 6, "96e9a1712272ef7b9a06728b00ad2617", "f3a2e3569534d9da237b1e340ebde018")],
    "t": [(0, 16, "376ec13d40249b60d566d90a6b266b70", "68273057a849b209bd0e0570bb8d0b0a"),
          (16, 16, "6dd419b2182f66a4f449705103c995d4", "51d17d8fc5d66fe37d1ef825ab72722f"),
          (32, 16, "b435eaea51f61acbb92d3ab01f6e398f", "195cb799e837c1b9a8fbbef6a07b437b"),
          (48, 16, "0f730fe604399d0147837c8e9b2559af", "ab5d17a4081973573774d3a57f007947"),
          (64, 6, "a4b5747bbf30ddcfe696cdc53aa53530", "779586eccf96cd0c70e0a21beda3d821")],
}


def _digest(*parts: bytes) -> str:
    """The key hash as it was: xxh3-128 over length-prefixed parts."""
    h = xxhash.xxh3_128()
    for part in parts:
        h.update(len(part).to_bytes(8, "little") + part)
    return h.hexdigest()


def _old_split(chunker: Chunker, token_ids, salt=None, include_partial=True) -> list[tuple]:
    """The fixed-size rule as it was: chunks every chunk_size tokens from 0, keys H(ns, parent, tokens) and
    H("content", ns, tokens)."""
    out, parent, size, n = [], chunker.root_key(salt), chunker.chunk_size, len(token_ids)
    ns = (chunker.namespace + "|salt=" + (salt or "")).encode()
    stop = n if include_partial else n - n % size
    for start in range(0, stop, size):
        ids = tuple(int(t) for t in token_ids[start:min(start + size, stop)])
        raw = np.asarray(ids, dtype=np.int64).tobytes()
        key = _digest(ns, parent.encode(), raw)
        out.append((start, ids, key, _digest(b"content", ns, raw), parent))
        parent = key
    return out


def test_window_zero_keys_are_the_stored_ones():
    chunker = Chunker(16, _NS)
    for salt, expected in _OLD_KEYS.items():
        chunks = chunker.split(_OLD_IDS, salt)
        assert [(c.start, len(c.token_ids), c.prefix_key, c.content_key) for c in chunks] == expected
        assert [c.complete for c in chunks] == [True] * 4 + [False]
    assert chunker.root_key() == "6974195c21ecb936b7a8686b0b963e4c"


@pytest.mark.parametrize("size", [4, 7, 16])
def test_window_zero_equals_the_old_rule(size):
    rng = random.Random(size)
    chunker = Chunker(size, "ns", 0, _CLASSES)  # a table is ignored at W = 0
    for n in [0, 1, size - 1, size, size + 1, 3 * size, 5 * size + 3]:
        ids = [rng.randrange(0, 60000) for _ in range(n)]
        for salt in (None, "tenant"):
            for partial in (True, False):
                new = [(c.start, c.token_ids, c.prefix_key, c.content_key, c.parent_key)
                       for c in chunker.split(ids, salt, include_partial=partial)]
                assert new == _old_split(chunker, ids, salt, partial)


# ---- boundary window ----------------------------------------------------------------------------------------
# A synthetic vocabulary: 1-2 end sentences, 3-39 start words, 40-99 continue words, 100 is both.
_CLASSES = np.zeros(101, dtype=np.uint8)
_CLASSES[1:3] = BOUNDARY_END
_CLASSES[3:40] = BOUNDARY_WORD
_CLASSES[100] = BOUNDARY_END | BOUNDARY_WORD


def _reference_spans(ids, size: int, w: int, classes) -> list[tuple[int, int, bool]]:
    """Brute force: every candidate cut scored by (class, closeness to nominal, earlier first)."""
    def cls(c: int) -> int:
        end = classes[ids[c - 1]] & BOUNDARY_END if ids[c - 1] < len(classes) else 0
        word = classes[ids[c]] & BOUNDARY_WORD if ids[c] < len(classes) else 0
        return 2 if end else (1 if word else 0)

    out, s, n = [], 0, len(ids)
    while s < n:
        nominal = s + size
        if nominal + w >= n:
            out.append((s, n, False))
            break
        cut = max(range(nominal - w, nominal + w + 1), key=lambda c: (cls(c), -abs(c - nominal), -c))
        out.append((s, cut, True))
        s = cut
    return out


def _random_ids(rng: random.Random, n: int, p_end: float, p_word: float) -> list[int]:
    out = []
    for _ in range(n):
        r = rng.random()
        out.append(rng.choice((1, 2, 100)) if r < p_end else rng.randrange(3, 40) if r < p_end + p_word
                   else rng.randrange(40, 200))  # >= 101: outside the table, no boundary
    return out


@pytest.mark.parametrize("size,w", [(8, 1), (8, 3), (16, 5), (16, 7), (32, 8)])
def test_cuts_pick_the_best_boundary_within_the_window(size, w):
    rng = random.Random(size * 100 + w)
    chunker = Chunker(size, "ns", w, _CLASSES)
    for _ in range(60):
        ids = _random_ids(rng, rng.randrange(0, 12 * size), *rng.choice([(0.05, 0.3), (0.0, 0.2), (0.0, 0.0)]))
        spans = chunker.spans(ids)
        assert spans == _reference_spans(ids, size, w, _CLASSES)
        assert [(c.start, c.end, c.complete) for c in chunker.split(ids)] == spans
        for start, stop, complete in spans:
            if complete:
                nominal = start + size
                assert abs(stop - nominal) <= w
                window = range(nominal - w, nominal + w + 1)
                if any(_CLASSES[ids[c - 1]] & BOUNDARY_END for c in window if ids[c - 1] <= 100):
                    assert ids[stop - 1] <= 100 and _CLASSES[ids[stop - 1]] & BOUNDARY_END
            else:
                assert stop == len(ids) and stop - start <= size + w


def test_cut_rule_on_a_hand_made_sequence():
    chunker = Chunker(8, "ns", 3, _CLASSES)
    filler = [50] * 30  # no boundary anywhere: nominal cuts
    assert [s[:2] for s in chunker.spans(filler)] == [(0, 8), (8, 16), (16, 24), (24, 30)]
    ids = list(filler)
    ids[6] = 1  # a sentence end: cut right after it (7), preferred over a closer word start
    ids[8] = 10
    assert chunker.spans(ids)[0][:2] == (0, 7)
    ids = list(filler)
    ids[9], ids[7] = 10, 11  # word starts at 9 and 7, both 1 from nominal 8: the earlier one wins
    assert chunker.spans(ids)[0][:2] == (0, 7)
    ids = list(filler)
    ids[12] = 1  # a sentence end outside the window [5, 11] does not count
    assert chunker.spans(ids)[0][:2] == (0, 8)


def test_window_never_decided_on_missing_tokens():
    chunker = Chunker(8, "ns", 3, _CLASSES)
    ids = [50] * 11
    # The first cut needs tokens through 8 + 3 = 11: with 11 tokens the whole sequence is one remainder.
    assert chunker.spans(ids) == [(0, 11, False)]
    assert chunker.spans(ids + [50]) == [(0, 8, True), (8, 12, False)]
    assert chunker.split(ids, include_partial=False) == []


@pytest.mark.parametrize("w", [0, 2, 7])
def test_prefix_of_a_sequence_gets_a_prefix_of_its_chunks(w):
    """Every complete chunk of a prefix is the longer sequence's chunk (same index, tokens, keys); the prefix's
    trailing incomplete chunk starts where one of the longer sequence's chunks starts, and one of the two is a
    prefix of the other (with W > 0 the trailing chunk is never complete)."""
    rng = random.Random(w)
    chunker = Chunker(16, "ns", w, _CLASSES)
    for _ in range(8):
        full = _random_ids(rng, 150, 0.04, 0.3)
        whole = chunker.split(full, "s")
        for p in range(len(full) + 1):
            part = chunker.split(full[:p], "s")
            for a in part:
                b = whole[a.index]
                if a.complete:
                    assert a == b
                else:
                    assert a is part[-1] and a.start == b.start and a.parent_key == b.parent_key
                    k = min(len(a.token_ids), len(b.token_ids))
                    assert a.token_ids[:k] == b.token_ids[:k]
            assert w == 0 or not part or not part[-1].complete
            # Cut as part of the longer sequence: exactly its chunks that end within the prefix.
            assert chunker.split(full, "s", end=p) == [c for c in whole if c.end <= p]


def test_cuts_depend_only_on_tokens():
    rng = random.Random(5)
    ids = _random_ids(rng, 200, 0.03, 0.3)
    a, b = Chunker(16, "ns", 5, _CLASSES.copy()), Chunker(16, "ns", 5, _CLASSES)
    assert a.split(ids) == b.split(ids) == a.split(list(ids)) == a.split(np.array(ids))
    assert a.spans(ids) == Chunker(16, "other", 5, _CLASSES).spans(ids)  # namespace and salt change keys only
    assert [c.prefix_key for c in a.split(ids, "x")] != [c.prefix_key for c in a.split(ids)]


def test_boundary_classes_of_a_real_tokenizer(tokenizer):
    classes = boundary_classes(tokenizer)
    assert classes.shape == (len(tokenizer),) and boundary_classes(tokenizer) is classes  # built once

    def cls(text: str) -> int:
        ids = tokenizer(text)["input_ids"]
        assert len(ids) == 1, (text, ids)
        return int(classes[ids[0]])

    assert cls(".") == cls("?") == cls(":") == cls("\n") == BOUNDARY_END
    assert cls(" river") == BOUNDARY_WORD and cls("river") == 0


def test_real_text_is_cut_after_sentences_or_before_words(tokenizer):
    classes = boundary_classes(tokenizer)
    sentences = " ".join(words(10, seed=i).capitalize() + "." for i in range(40))
    ids = tokenizer(sentences)["input_ids"]
    chunker = Chunker(32, "ns", 8, classes)
    chunks = chunker.split(ids)
    assert len(chunks) > 10 and any(len(c.token_ids) != 32 for c in chunks)
    for c in chunks[:-1]:  # a sentence (about 12 tokens) ends in every 17-token window
        assert tokenizer.decode(c.token_ids[-1:]) == "." and abs(c.end - c.start - 32) <= 8
    plain = tokenizer(words(300, seed=3))["input_ids"]  # no punctuation: cuts keep words whole
    for c in chunker.split(plain)[1:]:
        assert tokenizer.decode(c.token_ids[:1]).startswith(" ")
    assert [c.end for c in Chunker(32, "ns").split(ids, include_partial=False)] == list(range(32, len(ids) + 1, 32))


def test_engines_with_different_windows_never_share_keys(tokenizer):
    from kvboost import KVBoost

    model = make_tiny_model("llama", tokenizer)
    engines = [KVBoost(model, tokenizer, chunk_size=16, chunk_boundary_window=w) for w in (0, 3, 5)]
    assert len({e.namespace for e in engines}) == 3
    assert len({e.chunker.root_key() for e in engines}) == 3
    ids = [50] * 64  # the same cuts in every engine (no boundary), still different keys
    splits = [e.chunker.split(ids) for e in engines]
    assert splits[1][0].token_ids == splits[2][0].token_ids
    assert len({s[0].prefix_key for s in splits}) == 3 and len({s[0].content_key for s in splits}) == 3
    import torch
    fp = engines[0].fingerprint
    assert make_namespace(fp, torch.float32, 16, 16, 0) != make_namespace(fp, torch.float32, 16, 16, 3)
