"""Exact reuse must reproduce plain Hugging Face generation: same greedy tokens, first-token logits within 1e-4."""
from __future__ import annotations

import pytest
import torch

from kvboost import GenerationMode, KVBoost

from .prompts import text_with_tokens, words

CHUNK = 16
NEW = 12


def hf_greedy(model, tokenizer, ids: list[int], n: int) -> list[int]:
    x = torch.tensor([ids])
    with torch.inference_mode():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                             pad_token_id=tokenizer.eos_token_id)
    gen = out[0, len(ids):].tolist()
    eos = tokenizer.eos_token_id
    return gen[: gen.index(eos)] if eos in gen else gen


def hf_first_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0, -1].float()


@pytest.mark.parametrize("reused_chunks", [1, 2, 8])
def test_exact_reuse_matches_hf_generate(tiny, reused_chunks):
    model, tokenizer = tiny
    engine = KVBoost(model, tokenizer, chunk_size=CHUNK)
    prefix = text_with_tokens(tokenizer, reused_chunks * CHUNK + CHUNK // 2, seed=reused_chunks)  # + a partial tail
    prompt = prefix + " " + words(9, seed=99)
    warm = engine.warm(prefix)
    assert warm.chunks_stored >= reused_chunks
    engine.forget_workspace()  # reuse must come from stored chunks, not the resident workspace
    result = engine.generate(prompt, NEW, return_logits=True)
    ids = engine.encode(prompt)
    assert result.cached_tokens >= reused_chunks * CHUNK + 1  # whole chunks plus part of the partial tail
    assert result.cached_tokens < len(ids)
    assert result.output_token_ids == hf_greedy(model, tokenizer, ids, NEW)
    diff = (result.first_token_logits - hf_first_logits(model, ids)).abs().max().item()
    assert diff < 1e-4


def test_workspace_reuse_matches_hf_generate(tiny):
    model, tokenizer = tiny
    engine = KVBoost(model, tokenizer, chunk_size=CHUNK)
    base = text_with_tokens(tokenizer, 5 * CHUNK, seed=3)
    engine.generate(base + " first question", 6)
    prompt = base + " second question entirely"
    result = engine.generate(prompt, NEW, return_logits=True)
    ids = engine.encode(prompt)
    assert result.cached_tokens >= 5 * CHUNK - 2
    assert result.output_token_ids == hf_greedy(model, tokenizer, ids, NEW)
    assert (result.first_token_logits - hf_first_logits(model, ids)).abs().max().item() < 1e-4


def test_baseline_matches_hf_generate_and_reads_nothing(tiny):
    model, tokenizer = tiny
    engine = KVBoost(model, tokenizer, chunk_size=CHUNK)
    prompt = text_with_tokens(tokenizer, 3 * CHUNK, seed=5)
    engine.warm(prompt)
    result = engine.generate(prompt, NEW, mode=GenerationMode.BASELINE)
    assert result.cached_tokens == 0 and result.kv_reuse_ratio == 0.0
    assert result.output_token_ids == hf_greedy(model, tokenizer, engine.encode(prompt), NEW)


def test_prefix_cache_mode_reuses_whole_chunks_only(tiny):
    model, tokenizer = tiny
    engine = KVBoost(model, tokenizer, chunk_size=CHUNK)
    prefix = text_with_tokens(tokenizer, 2 * CHUNK + 5, seed=7)
    engine.warm(prefix)
    engine.forget_workspace()
    prompt = prefix + " " + words(6, seed=8)
    result = engine.generate(prompt, NEW, mode="prefix_cache")
    assert result.cached_tokens % CHUNK == 0 and result.cached_tokens >= 2 * CHUNK
    assert result.output_token_ids == hf_greedy(model, tokenizer, engine.encode(prompt), NEW)


def test_multi_turn_replay_identical_every_turn(tiny):
    model, tokenizer = tiny
    engine = KVBoost(model, tokenizer, chunk_size=CHUNK)
    messages = [{"role": "system", "content": words(40, seed=1)}]
    for turn in range(4):
        messages.append({"role": "user", "content": words(8 + 3 * turn, seed=10 + turn)})
        result = engine.generate(messages=messages, max_new_tokens=10)
        ids = engine.encode(messages=messages)
        assert result.output_token_ids == hf_greedy(model, tokenizer, ids, 10), f"turn {turn}"
        if turn > 0:
            assert result.kv_reuse_ratio > 0.5, f"turn {turn}: reuse {result.kv_reuse_ratio:.2f}"
        # The client re-sends the decoded reply; its re-tokenization may differ from the generated ids.
        messages.append({"role": "assistant", "content": result.output_text})


def test_seeded_sampling_same_tokens_in_baseline_and_reuse(tiny):
    model, tokenizer = tiny
    engine = KVBoost(model, tokenizer, chunk_size=CHUNK)
    prompt = text_with_tokens(tokenizer, 4 * CHUNK, seed=11)
    engine.warm(prompt)
    kwargs = dict(temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    base = engine.generate(prompt, NEW, mode="baseline", **kwargs)
    engine.forget_workspace()
    reused = engine.generate(prompt, NEW, **kwargs)
    assert reused.cached_tokens > 0
    assert base.output_token_ids == reused.output_token_ids
    other_seed = engine.generate(prompt, NEW, mode="baseline", **{**kwargs, "seed": 99})
    assert other_seed.output_token_ids != base.output_token_ids
