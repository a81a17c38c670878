"""Content reuse (RAG) on the block path: chunks stored in blocks - on the device or offloaded to the host - are
found at other positions, re-rotated into the workspace and repaired exactly as the store path does it."""
from __future__ import annotations

import pytest
import torch

from kvboost import KVBoost
from kvboost.errors import InvalidRequestError

from ..reuse._rag import CHUNK, documents, rag_prompt
from ..tiny_models import make_tiny_model

ORDERS = ([2, 0, 1], [1, 2], [0, 2, 1, 0])


def _rag(engine, docs: list[str], order: list[int]) -> object:
    engine.forget_workspace()  # the documents come from stored chunks, not a resident prefix
    return engine.generate(rag_prompt(docs, order), max_new_tokens=6, return_logits=True)


def _same(a, b) -> None:
    assert b.output_token_ids == a.output_token_ids
    assert (b.exact_tokens, b.approximate_tokens, b.recomputed_tokens) == \
        (a.exact_tokens, a.approximate_tokens, a.recomputed_tokens)
    assert torch.equal(b.first_token_logits, a.first_token_logits)


@pytest.mark.parametrize("arch,block", [("llama", None), ("qwen2", CHUNK // 4)])
def test_content_reuse_over_blocks_matches_the_store_path(tokenizer, device, arch, block):
    model = make_tiny_model(arch, tokenizer, device=device)
    extra = {} if block is None else {"kv_block_size": block}
    store = KVBoost(model, tokenizer, chunk_size=CHUNK, content_reuse=True)
    paged = KVBoost(model, tokenizer, chunk_size=CHUNK, content_reuse=True, paged_kv=True, **extra)
    docs = documents()
    for engine in (store, paged):
        for d in docs:
            assert engine.warm(d).chunks_stored > 0
    for order in ORDERS:
        want, got = _rag(store, docs, order), _rag(paged, docs, order)
        _same(want, got)
        assert got.approximate_tokens > 2 * CHUNK
    stats = paged.cache_stats()
    assert stats["content_index_chunks"] == store.cache_stats()["content_index_chunks"] > 0
    assert stats["paged_kv"]["blocks_used"] == stats["paged_kv"]["stored_blocks"]  # placement's holds are gone


def test_generated_chunks_are_found_at_other_positions_too(tokenizer, device):
    """A request's own write-back (not only warm) indexes its chunks for content reuse."""
    model = make_tiny_model("llama", tokenizer, device=device)
    store = KVBoost(model, tokenizer, chunk_size=CHUNK, content_reuse=True)
    paged = KVBoost(model, tokenizer, chunk_size=CHUNK, content_reuse=True, paged_kv=True)
    docs = documents()
    for engine in (store, paged):
        engine.generate(docs[0] + "\n\n" + docs[1], max_new_tokens=3)
    _same(_rag(store, docs, [1, 0]), _rag(paged, docs, [1, 0]))
    assert _rag(paged, docs, [1, 0]).approximate_tokens > CHUNK


def test_content_chunks_offloaded_to_the_host_come_back(tokenizer, device):
    model = make_tiny_model("llama", tokenizer, device=device)
    store = KVBoost(model, tokenizer, chunk_size=CHUNK, content_reuse=True)
    probe = KVBoost(model, tokenizer, chunk_size=CHUNK, paged_kv=True)
    block = probe.cache_stats()["paged_kv"]["block_bytes"]
    paged = KVBoost(model, tokenizer, chunk_size=CHUNK, content_reuse=True, paged_kv=True,
                    device_kv_budget_bytes=2 * block)  # two chunks on the device: the rest live on the host
    docs = documents()
    for engine in (store, paged):
        for d in docs:
            engine.warm(d)
    assert paged.cache_stats()["paged_kv"]["host"]["entries"] > 2
    _same(_rag(store, docs, [2, 0, 1]), _rag(paged, docs, [2, 0, 1]))
    assert paged.cache_stats()["paged_kv"]["host"]["restored"] > 0


def test_content_reuse_in_batches_over_blocks(tokenizer, device):
    model = make_tiny_model("llama", tokenizer, device=device)
    store = KVBoost(model, tokenizer, chunk_size=CHUNK, content_reuse=True)
    paged = KVBoost(model, tokenizer, chunk_size=CHUNK, content_reuse=True, paged_kv=True)
    docs = documents()
    prompts = [rag_prompt(docs, order) for order in ORDERS]
    for engine in (store, paged):
        for d in docs:
            engine.warm(d)
        engine.forget_workspace()
    for a, b in zip(store.generate_batch(prompts, max_new_tokens=5), paged.generate_batch(prompts, max_new_tokens=5)):
        assert b.output_token_ids == a.output_token_ids
        assert (b.exact_tokens, b.approximate_tokens) == (a.exact_tokens, a.approximate_tokens)
    assert any(r.approximate_tokens for r in paged.generate_batch(prompts[:2], max_new_tokens=2))


def test_table_attention_refuses_content_reuse(tokenizer):
    model = make_tiny_model("llama", tokenizer)
    with pytest.raises(ValueError, match="content_reuse"):
        KVBoost(model, tokenizer, chunk_size=CHUNK, paged_kv=True, paged_attention="table", content_reuse=True)
    table = KVBoost(model, tokenizer, chunk_size=CHUNK, paged_kv=True, paged_attention="table")
    with pytest.raises(InvalidRequestError, match="content_reuse"):
        table.generate(rag_prompt(documents(), [1, 0]), max_new_tokens=2, content_reuse=True)
    assert table.generate("plain prompt", max_new_tokens=2).generated_tokens == 2
