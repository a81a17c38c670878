"""Draft-model speculation: greedy output identical to plain greedy; the draft engine reuses its own prompt
prefix; vocabularies that differ are refused."""
from __future__ import annotations

import pytest

from kvboost import KVBoost
from kvboost.errors import InvalidRequestError

from ..prompts import text_with_tokens
from ..tiny_models import make_tiny_model


def test_draft_model_greedy_is_identical_and_reuses_its_prefix(tokenizer):
    target = make_tiny_model("llama", tokenizer, seed=0)
    # The target itself as draft: every draft is accepted (proves proposals line up); a different random
    # model: most are rejected (proves rollback). Both must give the plain greedy output.
    for draft, expect_all in ((make_tiny_model("llama", tokenizer, seed=0), True),
                              (make_tiny_model("qwen2", tokenizer, seed=5), False)):
        engine = KVBoost(target, tokenizer, chunk_size=16, draft_model=draft)
        prompt = text_with_tokens(tokenizer, 50, seed=2)
        plain = engine.generate(prompt, 24)
        spec = engine.generate(prompt, 24, speculative="draft", num_speculative_tokens=4)
        assert spec.output_token_ids == plain.output_token_ids and spec.speculative == "draft"
        assert spec.draft_tokens > 0
        if expect_all:
            assert spec.accepted_tokens == spec.draft_tokens
        again = engine.generate(prompt + " more", 8, speculative="draft")
        assert again.draft_tokens > 0
        assert engine.draft.workspace.resident_ids[:16] == engine.encode(prompt)[:16]  # the draft kept its prefix


def test_draft_vocabulary_must_match(tokenizer):
    target = make_tiny_model("llama", tokenizer)
    from transformers import AutoModelForCausalLM

    from ..tiny_models import tiny_config

    small_vocab = AutoModelForCausalLM.from_config(tiny_config("llama", 1000))
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        KVBoost(target, tokenizer, draft_model=small_vocab)
    with pytest.raises(InvalidRequestError, match="draft_model"):
        KVBoost(target, tokenizer, draft_model=42)


def test_a_draft_attached_after_load_is_used_and_detaching_refuses_draft_requests(tokenizer):
    from kvboost.decoding.factory import make_draft_engine

    engine = KVBoost(make_tiny_model("llama", tokenizer, seed=0), tokenizer, chunk_size=16)
    prompt = text_with_tokens(tokenizer, 40, seed=3)
    with pytest.raises(InvalidRequestError, match="draft_model"):
        engine.generate(prompt, 8, speculative="draft")
    engine.draft = make_draft_engine(engine, make_tiny_model("llama", tokenizer, seed=0))  # as kvboost bench spec does
    spec = engine.generate(prompt, 12, speculative="draft", num_speculative_tokens=4)
    assert spec.output_token_ids == engine.generate(prompt, 12).output_token_ids and spec.draft_tokens > 0
    engine.draft = None
    with pytest.raises(InvalidRequestError, match="draft_model"):
        engine.generate(prompt, 8, speculative="draft")
