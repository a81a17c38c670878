"""The embedded SmolLM2-135M: fidelity of exact reuse, multi-turn chat, verify_correctness."""
from __future__ import annotations

import pytest

from kvboost import KVBoost

from .hf_reference import hf_first_logits, hf_greedy
from .prompts import text_with_tokens, words

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(smol):
    model, tokenizer = smol
    return KVBoost(model, tokenizer)  # default chunk size 128


@pytest.mark.parametrize("reused_chunks", [1, 2, 8])
def test_exact_reuse_identical_to_hf(engine, reused_chunks):
    tok = engine.tokenizer
    prefix = text_with_tokens(tok, reused_chunks * 128 + 40, seed=reused_chunks)
    prompt = prefix + "\nQuestion: which word appears most often above?\nAnswer:"
    engine.warm(prefix)
    engine.forget_workspace()
    result = engine.generate(prompt, 16, return_logits=True)
    ids = engine.encode(prompt)
    assert result.cached_tokens >= reused_chunks * 128 + 1
    assert result.output_token_ids == hf_greedy(engine.model, tok, ids, 16)
    assert (result.first_token_logits - hf_first_logits(engine.model, ids)).abs().max().item() < 1e-4


def test_multi_turn_chat_identical_and_reused(engine):
    messages = [{"role": "system", "content": "You are a concise travel assistant. " + words(150, seed=4)}]
    questions = ["Plan a day in Lisbon.", "What about the evening?", "Any food tips?", "And the budget?"]
    for turn, q in enumerate(questions):
        messages.append({"role": "user", "content": q})
        result = engine.generate(messages=messages, max_new_tokens=24)
        ids = engine.encode(messages=messages)
        assert result.output_token_ids == hf_greedy(engine.model, engine.tokenizer, ids, 24), f"turn {turn}"
        if turn:
            assert result.kv_reuse_ratio > 0.8
        messages.append({"role": "assistant", "content": result.output_text})


def test_verify_correctness_report(engine):
    report = engine.verify_correctness(max_new_tokens=12)
    assert len(report.checks) == 3
    assert all(c.reused_chunks >= 2 for c in report.checks)
    assert report and report.all_identical
    assert report.max_logit_diff < 1e-4
