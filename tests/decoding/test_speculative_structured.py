"""Speculative decoding composed with structured output and logprobs: drafts are checked against the grammar, the
sampler masks and reports every emitted token as it would without speculation, greedy output stays identical."""
from __future__ import annotations

import json

import pytest

from kvboost import KVBoost

from ..prompts import text_with_tokens
from ..tiny_models import make_tiny_eos_model
from .test_speculative import _script

pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                           "n": {"type": "integer", "minimum": 1, "maximum": 99}},
          "required": ["color", "n"]}
FORMAT = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def engine(tokenizer):
    return KVBoost(make_tiny_eos_model("llama", tokenizer), tokenizer, chunk_size=16)


def _valid(text: str) -> bool:
    try:
        obj = json.loads(text)
    except ValueError:
        return False
    return obj.get("color") in ("red", "green", "blue") and isinstance(obj.get("n"), int) and 1 <= obj["n"] <= 99


@pytest.mark.parametrize("wrong", [0.0, 0.5, 1.0])
def test_greedy_constrained_output_is_identical_with_speculation(engine, wrong, monkeypatch):
    prompt = text_with_tokens(engine.tokenizer, 40, seed=2)
    plain = engine.generate(prompt, 200, response_format=FORMAT)
    assert _valid(plain.output_text)
    made = _script(monkeypatch, plain.output_token_ids, wrong)
    spec = engine.generate(prompt, 200, response_format=FORMAT, speculative="prompt_lookup", num_speculative_tokens=6)
    assert spec.output_token_ids == plain.output_token_ids and spec.finish_reason == plain.finish_reason
    # Drafts the grammar forbids are cut before the verify forward: never more verified than proposed.
    assert 0 < spec.draft_tokens <= made[0].proposed
    if wrong == 0.0:
        assert spec.accepted_tokens == spec.draft_tokens
    if wrong == 1.0:
        assert spec.draft_tokens < made[0].proposed  # the corrupted drafts were mostly outside the grammar


def test_garbage_drafts_never_leave_the_grammar(engine, monkeypatch):
    """A proposer of tokens that break the JSON: output is the plain constrained output, nothing invalid kept."""
    prompt = text_with_tokens(engine.tokenizer, 30, seed=5)
    plain = engine.generate(prompt, 200, response_format=FORMAT)
    made = _script(monkeypatch, [engine.tokenizer.encode("}}}")[0]] * 400, 0.0)
    spec = engine.generate(prompt, 200, response_format=FORMAT, speculative="prompt_lookup")
    assert spec.output_token_ids == plain.output_token_ids
    assert made[0].proposed > 0 and spec.accepted_tokens <= spec.draft_tokens


def test_logprobs_are_reported_per_token_as_without_speculation(engine, monkeypatch):
    prompt = text_with_tokens(engine.tokenizer, 40, seed=4)
    plain = engine.generate(prompt, 16, logprobs=2)
    _script(monkeypatch, plain.output_token_ids, 0.3)
    spec = engine.generate(prompt, 16, logprobs=2, speculative="prompt_lookup", num_speculative_tokens=4)
    assert spec.output_token_ids == plain.output_token_ids and spec.accepted_tokens > 0
    assert [lp.token for lp in spec.logprobs] == spec.output_token_ids
    for a, b in zip(spec.logprobs, plain.logprobs):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-3)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_sampled_constrained_output_with_speculation_is_valid(engine):
    for seed in range(3):
        prompt = text_with_tokens(engine.tokenizer, 30, seed=seed)
        r = engine.generate(prompt, 200, response_format=FORMAT, temperature=1.0, seed=seed,
                            speculative="prompt_lookup")
        assert _valid(r.output_text), r.output_text


def test_output_closed_at_the_budget_is_identical_with_speculation(tokenizer):
    """Near max_new_tokens the grammar forces the output closed, counting the tokens emitted so far. Checking
    drafts against the grammar must not change that count (it once did: each check took its drafts off it, so
    the speculative output closed later than the plain one)."""
    from ..tiny_models import make_tiny_model

    engine = KVBoost(make_tiny_model("llama", tokenizer), tokenizer, chunk_size=16)
    prompt, regex = "river stone lantern quiet orbit " * 6, r"(river|stone|lantern|quiet|orbit| )+"
    plain = engine.generate(prompt, 30, regex=regex)
    assert plain.finish_reason == "length" and plain.generated_tokens < 30  # closed (and stopped) by the budget
    spec = engine.generate(prompt, 30, regex=regex, speculative="prompt_lookup", prompt_lookup_min_ngram=1)
    assert spec.draft_tokens > 0
    assert spec.output_token_ids == plain.output_token_ids and spec.finish_reason == plain.finish_reason
    constraint = engine.request(prompt, 30, regex=regex).sampler(engine.device).constraint
    ids = plain.output_token_ids[:5]
    assert constraint.accepted_prefix(ids) == 5 and constraint.emitted == 0
    for token in ids:
        constraint.advance(token)
    assert constraint.accepted_prefix(plain.output_token_ids[5:9]) == 4 and constraint.emitted == 5
