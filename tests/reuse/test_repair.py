"""Repair strategies over placed K/V: the end points are exact (r = 1 is full prefill, r = 0 is none), exact
prefixes are never repaired, and nothing approximate leaks into the workspace's resident prefix or the store."""
from __future__ import annotations

import math

import pytest
import torch

from kvboost import GenerationMode, KVBoost
from kvboost.reuse import repair

from ..devices import assert_on
from ..hf_reference import hf_greedy
from ..tiny_models import make_tiny_model
from ._rag import CHUNK, documents, full_forward, rag_prompt

NEW = 8


def _engine(model, tokenizer, strategy: str = "cacheblend", ratio: float = 0.15, **kw) -> KVBoost:
    return KVBoost(model, tokenizer, content_reuse=True, chunk_size=CHUNK, recompute_strategy=strategy,
                   recompute_ratio=ratio, **kw)


def _run(engine, prompt: str, strategy: str, ratio: float = 0.0, new: int = 1):
    engine.config.recompute_strategy, engine.config.recompute_ratio = strategy, ratio
    engine.forget_workspace()  # reuse must come from the store
    return engine.generate(prompt, new, return_logits=True)


@pytest.fixture
def warmed(tiny):
    model, tokenizer = tiny
    engine = _engine(model, tokenizer)
    docs = documents()
    for d in docs:
        engine.warm(d)
    return engine, rag_prompt(docs, [2, 0, 1])


def test_cacheblend_r1_equals_full_prefill(warmed, device):
    engine, prompt = warmed
    result = _run(engine, prompt, "cacheblend", 1.0, new=NEW)
    assert_on(device, result.first_token_logits)
    ids = engine.encode(prompt)
    assert result.approximate_tokens > 0.8 * len(ids)
    assert result.recomputed_tokens == result.approximate_tokens
    logits, _ = full_forward(engine.model, ids)
    assert (result.first_token_logits - logits).abs().max().item() < 1e-4
    assert result.output_token_ids == hf_greedy(engine.model, engine.tokenizer, ids, NEW)


def test_cacheblend_r0_equals_none(warmed):
    engine, prompt = warmed
    none = _run(engine, prompt, "none", new=NEW)
    blend0 = _run(engine, prompt, "cacheblend", 0.0, new=NEW)
    assert none.recomputed_tokens == blend0.recomputed_tokens == 0
    assert none.approximate_tokens == blend0.approximate_tokens > 0
    assert torch.equal(none.first_token_logits, blend0.first_token_logits)
    assert none.output_token_ids == blend0.output_token_ids


def test_blocked_layer_calls_equal_one_call(tokenizer, monkeypatch):
    """Query rows are run in position-ordered blocks so attention skips later keys; the result must not change."""
    model = make_tiny_model("gemma2", tokenizer)  # eager attention and sliding layers
    engine = _engine(model, tokenizer)
    docs = documents()
    for d in docs:
        engine.warm(d)
    prompt = rag_prompt(docs, [1, 2, 0])
    one = _run(engine, prompt, "cacheblend", 0.3)
    monkeypatch.setattr(repair, "_BLOCK_ROWS", 8)
    many = _run(engine, prompt, "cacheblend", 0.3)
    assert (one.first_token_logits - many.first_token_logits).abs().max().item() < 1e-4
    full = _run(engine, prompt, "cacheblend", 1.0)
    logits, _ = full_forward(model, engine.encode(prompt))
    assert (full.first_token_logits - logits).abs().max().item() < 1e-4


def test_token_accounting_and_cost_grow_with_r(tokenizer):
    model = make_tiny_model("llama", tokenizer, num_hidden_layers=4)
    engine = _engine(model, tokenizer)
    docs = documents()
    for d in docs:
        engine.warm(d)
    engine.warm("Intro: read these notes.")
    prompt = rag_prompt(docs, [0, 2, 1])
    n = len(engine.encode(prompt))
    results = {r: _run(engine, prompt, "cacheblend", r) for r in (0.05, 0.15, 0.3)}
    for r, res in results.items():
        assert res.exact_tokens > 0  # the warmed intro is an exact prefix
        assert res.cached_tokens == res.exact_tokens + res.approximate_tokens < n
        assert res.kv_reuse_ratio == pytest.approx(res.cached_tokens / n)
        assert res.recomputed_tokens == math.ceil(r * res.approximate_tokens)
    selective = _run(engine, prompt, "selective")
    assert selective.recomputed_tokens == 3 * engine.config.recompute_overlap  # one seam per document


def test_warmed_order_takes_the_exact_path(tiny):
    model, tokenizer = tiny
    engine = _engine(model, tokenizer)
    docs = documents()
    for d in docs:
        engine.warm(d)
    context = rag_prompt(docs, [0, 1, 2], question="")
    engine.warm(context)
    prompt = context + "Question: which word came first?"
    result = _run(engine, prompt, "cacheblend", 0.15, new=NEW)
    ids = engine.encode(prompt)
    assert result.approximate_tokens == 0 and result.recomputed_tokens == 0
    assert result.exact_tokens == result.cached_tokens >= len(engine.encode(context)) - 2
    assert result.output_token_ids == hf_greedy(model, tokenizer, ids, NEW)


def test_exact_prefix_is_never_repaired_and_approximate_kv_never_trusted_later(tokenizer):
    model = make_tiny_model("qwen2", tokenizer)
    engine = _engine(model, tokenizer)
    docs = documents()
    for d in docs:
        engine.warm(d)
    intro = "Intro: read these notes."
    engine.warm(intro)
    prompt = rag_prompt(docs, [1, 0])
    ids = engine.encode(prompt)
    _, cache = full_forward(model, ids)
    result = _run(engine, prompt, "cacheblend", 0.15, new=NEW)
    exact = result.exact_tokens
    assert exact > 0 and result.approximate_tokens > 0
    # The exact prefix's K/V is what the model computes, in every layer (repair never touched it).
    for i, layer in enumerate(cache.layers):
        k_buf, _ = engine.workspace.buffers(i)
        assert (k_buf[:, :, :exact] - layer.keys[:, :, :exact]).abs().max().item() < 1e-4
    # Nothing after the exact prefix may be trusted by the next request or stored under prefix-chain keys.
    assert engine.workspace.resident_ids == ids[:exact]
    later = [c for c in engine.chunker.split(ids) if c.end > exact]
    assert later and not any(engine.store.contains(c.prefix_key) for c in later)
    again = engine.generate(prompt, NEW, mode="baseline")
    assert again.output_token_ids == hf_greedy(model, tokenizer, ids, NEW)


@pytest.mark.parametrize("mode", [GenerationMode.BASELINE, GenerationMode.PREFIX_CACHE])
def test_baseline_and_prefix_cache_never_use_content_matches(tokenizer, mode):
    model = make_tiny_model("llama", tokenizer)
    engine = _engine(model, tokenizer)
    docs = documents()
    for d in docs:
        engine.warm(d)
    prompt = rag_prompt(docs, [2, 1])
    engine.forget_workspace()
    result = engine.generate(prompt, NEW, mode=mode)
    assert result.approximate_tokens == 0 and result.recomputed_tokens == 0
    assert result.output_token_ids == hf_greedy(model, tokenizer, engine.encode(prompt), NEW)


def test_repair_shrinks_the_distance_to_full_prefill(tokenizer):
    """On average over prompts, recomputing more tokens brings the first-token distribution closer."""
    model = make_tiny_model("llama", tokenizer, num_hidden_layers=6)  # selection needs layers after the probes
    engine = _engine(model, tokenizer)
    docs = documents(4)
    for d in docs:
        engine.warm(d)
    dist = {"none": 0.0, "cb.3": 0.0, "cb1": 0.0}
    for order in ([0, 1, 2], [3, 1, 0], [2, 3, 1]):
        prompt = rag_prompt(docs, order)
        logits, _ = full_forward(model, engine.encode(prompt))
        for key, strat, r in (("none", "none", 0.0), ("cb.3", "cacheblend", 0.3), ("cb1", "cacheblend", 1.0)):
            dist[key] += (_run(engine, prompt, strat, r).first_token_logits - logits).abs().max().item()
    assert dist["cb1"] < 1e-3 < dist["cb.3"] < dist["none"]
