"""The engine with paged_kv=True against paged_kv=False: the same tokens, reuse counts and first-token logits
(bit for bit) on every request path (generate, multi-turn, prefix-cache mode, warm, batches), with stored chunks
living in pool blocks instead of the memory tier."""
from __future__ import annotations

import pytest
import torch

from kvboost import KVBoost
from kvboost.kv.blocks import BlockLayoutError

from ..prompts import words
from ..tiny_models import make_tiny_model

CHUNK = 16


def _pair(model, tokenizer, **kw):
    return (KVBoost(model, tokenizer, chunk_size=CHUNK, **kw),
            KVBoost(model, tokenizer, chunk_size=CHUNK, paged_kv=True, **kw))


def _same(a, b) -> None:
    assert a.output_token_ids == b.output_token_ids
    assert (a.cached_tokens, a.exact_tokens) == (b.cached_tokens, b.exact_tokens)
    if a.first_token_logits is not None:
        assert torch.equal(a.first_token_logits, b.first_token_logits)


def _session(engine, forget: bool) -> list:
    """Requests that hit whole chunks, token-granular remainders, the resident workspace and plain misses."""
    system = words(30, seed=1)
    out = []
    first = engine.generate(system + " " + words(8, seed=2), max_new_tokens=6, return_logits=True)
    out.append(first)
    turns = [system + " " + words(8, seed=2) + first.output_text + " " + words(9, seed=3),
             system + " " + words(12, seed=4), words(20, seed=5), system + " " + words(8, seed=2)]
    for prompt in turns:
        if forget:
            engine.forget_workspace()  # reuse must come from the stored chunks (blocks), not the workspace
        out.append(engine.generate(prompt, max_new_tokens=6, return_logits=True))
    out.append(engine.generate(system + " " + words(5, seed=6), max_new_tokens=4, mode="prefix_cache",
                               return_logits=True))
    return out


@pytest.mark.parametrize("arch,block", [("llama", None), ("qwen2", CHUNK // 4), ("gemma3", CHUNK // 2)])
@pytest.mark.parametrize("forget", [False, True])
def test_paged_engine_identical_outputs(tokenizer, device, arch, block, forget):
    model = make_tiny_model(arch, tokenizer, device=device)
    today, paged = _pair(model, tokenizer) if block is None else _pair(model, tokenizer, kv_block_size=block)
    want, got = _session(today, forget), _session(paged, forget)
    for a, b in zip(want, got):
        _same(a, b)
    assert sum(r.cached_tokens for r in got) > 2 * CHUNK
    stats = paged.cache_stats()
    assert stats["paged_kv"]["stored_chunks"] > 0 and stats["tiers"]["memory"]["entries"] == 0
    assert stats["paged_kv"]["stored_chunks"] == today.cache_stats()["tiers"]["memory"]["entries"]
    assert stats["paged_kv"]["blocks_used"] == stats["paged_kv"]["stored_blocks"]  # no request holds any now


def test_paged_engine_warm_and_batches(tokenizer, device):
    model = make_tiny_model("llama", tokenizer, device=device)
    today, paged = _pair(model, tokenizer)
    system = words(40, seed=7)
    prompts = [system + " " + words(6, seed=s) for s in range(8, 12)] + [words(15, seed=12)]
    for engine in (today, paged):
        assert engine.warm(system)
        engine.forget_workspace()
    for a, b in zip(today.generate_batch(prompts, max_new_tokens=5), paged.generate_batch(prompts, max_new_tokens=5)):
        _same(a, b)
    for a, b in zip(today.generate_many(prompts, max_new_tokens=5), paged.generate_many(prompts, max_new_tokens=5)):
        _same(a, b)
    assert paged.cache_stats()["paged_kv"]["hits"] > 0
    paged.clear_cache()
    assert paged.cache_stats()["paged_kv"]["stored_chunks"] == 0


def test_paged_engine_refuses_what_it_cannot_do_yet(tokenizer):
    model = make_tiny_model("llama", tokenizer, device="cpu")
    for bad in (dict(chunk_boundary_window=3), dict(kv_block_size=5)):
        with pytest.raises(ValueError):
            KVBoost(model, tokenizer, chunk_size=CHUNK, paged_kv=True, **bad)
    with pytest.raises(BlockLayoutError):  # layers whose K/V shapes differ cannot share one block layout
        from kvboost.kv.paged_kv import build_paged_kv
        from kvboost.kv.workspace import LayerShape

        build_paged_kv(paged_chunker(), [LayerShape(2, 8, 8), LayerShape(1, 8, 8)], torch.float32,
                       torch.device("cpu"), 1 << 20)


def paged_chunker():
    from kvboost.chunking import Chunker

    return Chunker(CHUNK, "ns")


@pytest.mark.slow
def test_paged_engine_identical_on_smollm2(smol):
    model, tokenizer = smol
    today, paged = _pair(model, tokenizer)
    for a, b in zip(_session(today, forget=True), _session(paged, forget=True)):
        _same(a, b)


# ---- paged_attention="table": single requests over their block table, no workspace ----------------------------
@pytest.mark.parametrize("arch,block", [("llama", None), ("qwen2", CHUNK // 4)])
@pytest.mark.parametrize("forget", [False, True])
def test_forwards_over_the_table_give_the_same_outputs(tokenizer, device, arch, block, forget):
    model = make_tiny_model(arch, tokenizer, device=device)
    extra = {} if block is None else {"kv_block_size": block}
    today = KVBoost(model, tokenizer, chunk_size=CHUNK, **extra)
    table = KVBoost(model, tokenizer, chunk_size=CHUNK, paged_kv=True, paged_attention="table", **extra)
    for a, b in zip(_session(today, forget), _session(table, forget)):
        assert a.output_token_ids == b.output_token_ids
        # The workspace keeps a prompt resident across requests; a table maps stored chunks (whole, or a stored
        # sibling's first tokens), so the table reuses at most what the workspace does.
        assert b.cached_tokens <= a.cached_tokens
        if a.first_token_logits is not None:
            torch.testing.assert_close(a.first_token_logits, b.first_token_logits, rtol=1e-4, atol=1e-4)
    stats = table.cache_stats()
    assert stats["paged_attention"] == "table" and stats["paged_kv"]["hits"] > 0
    assert table.workspace.resident_ids == []  # nothing ran over the workspace
    assert stats["paged_kv"]["blocks_used"] == stats["paged_kv"]["stored_blocks"]  # every request's holds went


def test_forwards_over_the_table_with_speculation_and_streams(tokenizer):
    model = make_tiny_model("llama", tokenizer)
    today = KVBoost(model, tokenizer, chunk_size=CHUNK)
    table = KVBoost(model, tokenizer, chunk_size=CHUNK, paged_kv=True, paged_attention="table")
    prompt = words(30, seed=21) + " " + words(30, seed=21)  # repetitive: prompt lookup drafts get accepted
    want = today.generate(prompt, max_new_tokens=24)
    got = table.generate(prompt, max_new_tokens=24, speculative="prompt_lookup")
    assert got.output_token_ids == want.output_token_ids
    streamed = "".join(table.generate_stream(prompt, max_new_tokens=24))
    assert streamed == want.output_text
    again = table.generate(prompt, max_new_tokens=24)  # prompt + output were stored as the table's blocks
    assert again.output_token_ids == want.output_token_ids and again.cached_tokens >= 2 * CHUNK
    base = table.generate(prompt, max_new_tokens=8, mode="baseline")
    assert base.cached_tokens == 0 and base.output_token_ids == want.output_token_ids[:8]
    stats = table.cache_stats()["paged_kv"]
    assert stats["blocks_used"] == stats["stored_blocks"]


def test_table_forwards_are_refused_where_they_cannot_be_exact(tokenizer):
    with pytest.raises(ValueError, match="paged_kv"):
        KVBoost(make_tiny_model("llama", tokenizer), tokenizer, paged_attention="table")
    with pytest.raises(ValueError, match="paged_attention"):
        KVBoost(make_tiny_model("llama", tokenizer), tokenizer, paged_kv=True, paged_attention="tables")
    with pytest.raises(ValueError, match="sliding"):
        KVBoost(make_tiny_model("gemma3", tokenizer), tokenizer, chunk_size=CHUNK, paged_kv=True,
                paged_attention="table")
