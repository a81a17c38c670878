"""Assembly: stored chunks land at their new positions with keys re-rotated exactly, or not at all."""
from __future__ import annotations

import pytest
import torch

from kvboost import GenerationMode, KVBoost
from kvboost.reuse.repair import repair_support

from ..hf_reference import hf_greedy
from ..tiny_models import make_tiny_model
from ._rag import CHUNK, documents, full_forward, rag_prompt


def _placed_plan(engine, prompt: str):
    """The KV-cache manager's plan for the prompt, placed into the engine's (emptied) workspace."""
    ids = engine.encode(prompt)
    engine.forget_workspace()
    with torch.inference_mode():
        plan = engine.kv.lookup(ids, None, GenerationMode.CHUNK_KV_REUSE, approximate=True)
        engine.workspace.ensure_capacity(len(ids) + 4, keep=0)
        engine.kv.place(plan, engine.workspace, ids)
    return ids, plan


def test_layer0_kv_of_placed_tokens_equals_a_fresh_forward(tiny):
    """Layer 0 sees no context, so re-rotated stored K and copied V must equal the model's own at the new position."""
    model, tokenizer = tiny
    engine = KVBoost(model, tokenizer, content_reuse=True, chunk_size=CHUNK)
    docs = documents()
    for d in docs:
        engine.warm(d)
    ids, plan = _placed_plan(engine, rag_prompt(docs, [2, 0, 1]))
    assert plan.assembly is not None and plan.content_fallback is None
    mask = plan.assembly.mask(len(ids), device=engine.device)
    assert plan.assembly.n_tokens == int(mask.sum()) >= sum(len(tokenizer(d)["input_ids"]) for d in docs) - 3
    assert len(plan.assembly.segments) == 3  # one seam per document
    _, cache = full_forward(model, ids)
    pos = mask.nonzero().flatten()
    k_buf, v_buf = engine.workspace.buffers(0)
    fresh = cache.layers[0]
    assert (k_buf[:, :, pos] - fresh.keys[:, :, pos]).abs().max().item() < 1e-4
    assert (v_buf[:, :, pos] - fresh.values[:, :, pos]).abs().max().item() < 1e-4


def test_unrotatable_positions_fall_back_to_prefill(tokenizer):
    """Dynamic NTK RoPE depends on the pass length: content matches are refused, the prompt is prefilled exactly."""
    model = make_tiny_model("llama", tokenizer, rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                                 "rope_theta": 10000.0})
    engine = KVBoost(model, tokenizer, content_reuse=True, chunk_size=CHUNK)
    docs = documents()
    for d in docs:
        engine.warm(d)
    prompt = rag_prompt(docs, [1, 0])
    ids, plan = _placed_plan(engine, prompt)
    assert plan.assembly is None and "dynamic" in plan.content_fallback
    engine.forget_workspace()
    result = engine.generate(prompt, 8)
    assert result.approximate_tokens == 0
    assert result.output_token_ids == hf_greedy(model, tokenizer, ids, 8)


def test_attention_without_explicit_masks_is_refused(tokenizer):
    model = make_tiny_model("llama", tokenizer)
    assert repair_support(model) is None
    model.config._attn_implementation = "flash_attention_2"
    try:
        assert "flash_attention_2" in repair_support(model)
    finally:
        model.config._attn_implementation = "sdpa"


def test_evicted_chunks_are_dropped_and_their_tokens_prefilled(tokenizer):
    model = make_tiny_model("qwen2", tokenizer)
    engine = KVBoost(model, tokenizer, content_reuse=True, chunk_size=CHUNK)
    docs = documents(2, 50)
    for d in docs:
        engine.warm(d)
    prompt = rag_prompt(docs, [1, 0])
    ids, plan = _placed_plan(engine, prompt)
    whole = plan.assembly.n_tokens
    victim = plan.assembly.segments[0].pieces[1]  # the middle of the first placed document
    engine.store.delete(victim.key)
    ids, plan = _placed_plan(engine, prompt)
    assert plan.assembly.n_tokens == whole - victim.n_tokens
    assert len(plan.assembly.segments) == 3  # the run after the hole has a seam of its own
    assert victim.key not in engine.kv.content.index
    placed = plan.assembly.mask(len(ids), device=engine.device)
    assert not placed[victim.start:victim.end].any()


@pytest.mark.parametrize("sink", [0, 40])
def test_sink_tokens_are_never_placed(tokenizer, sink):
    model = make_tiny_model("llama", tokenizer)
    engine = KVBoost(model, tokenizer, content_reuse=True, chunk_size=CHUNK, sink_tokens=sink)
    docs = documents(2)
    for d in docs:
        engine.warm(d)
    ids, plan = _placed_plan(engine, rag_prompt(docs, [0, 1]))
    first = plan.assembly.mask(len(ids), device=engine.device).nonzero().flatten()[0].item()
    assert first >= sink and (sink == 0 or first == sink)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_boundary_window_documents_are_found_in_another_order(arch, tokenizer):
    """RAG with moving cuts: each warmed document (chunks of varying length, a remainder of up to CHUNK + W
    tokens) is found whole at its new position, placed exactly in layer 0, and r = 1 repair is full prefill."""
    from ..prompts import words

    model = make_tiny_model(arch, tokenizer)
    engine = KVBoost(model, tokenizer, content_reuse=True, chunk_size=CHUNK, chunk_boundary_window=5,
                     recompute_strategy="cacheblend", recompute_ratio=1.0)
    docs = [" ".join(words(3 + (i + j) % 6, seed=10 * i + j).capitalize() + "." for j in range(6)) for i in range(3)]
    lengths = []
    for d in docs:
        engine.warm(d)
        lengths += [len(c.token_ids) for c in engine.chunker.split(engine.encode(d))[:-1]]
    assert len(set(lengths)) > 1  # the cuts moved
    prompt = rag_prompt(docs, [2, 0, 1])
    ids, plan = _placed_plan(engine, prompt)
    assert plan.assembly is not None and len(plan.assembly.segments) == 3  # one seam per document
    assert plan.assembly.n_tokens >= sum(len(tokenizer(d)["input_ids"]) for d in docs) - 3
    mask = plan.assembly.mask(len(ids), device=engine.device)
    _, cache = full_forward(model, ids)
    pos = mask.nonzero().flatten()
    k_buf, v_buf = engine.workspace.buffers(0)
    assert (k_buf[:, :, pos] - cache.layers[0].keys[:, :, pos]).abs().max().item() < 1e-4
    assert (v_buf[:, :, pos] - cache.layers[0].values[:, :, pos]).abs().max().item() < 1e-4
    engine.forget_workspace()
    result = engine.generate(prompt, 8)
    assert result.approximate_tokens == plan.assembly.n_tokens
    assert result.output_token_ids == hf_greedy(model, tokenizer, ids, 8)
