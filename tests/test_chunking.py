from __future__ import annotations

from kvboost.chunking import Chunker, make_namespace, model_fingerprint

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
