"""Finishing structured output inside max_new_tokens (decoding/closing.py through constraint.py and the engine)."""
from __future__ import annotations

import pytest

from benchmarks.structured import schema_valid
from kvboost import KVBoost
from kvboost.decoding.closing import HORIZON, ClosingPlanner, closing_vocab

from ..prompts import text_with_tokens
from ..tiny_models import make_tiny_eos_model

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

# Unbounded values a random model can loop in: an array of strings and a free string, both required.
SCHEMA = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}},
                                           "note": {"type": "string"}, "n": {"type": "integer"}},
          "required": ["tags", "note", "n"]}
FORMAT = {"type": "json_schema", "json_schema": {"name": "loop", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def engine(tokenizer):
    return KVBoost(make_tiny_eos_model("llama", tokenizer), tokenizer, chunk_size=16)


def test_closing_tokens_are_single_characters(tokenizer):
    chars = dict(closing_vocab(tokenizer, len(tokenizer)).chars)
    for c in '}]"0,:':
        assert tokenizer.decode([chars[c]]) == c


def _planner(compiled, constraint, tokenizer) -> ClosingPlanner:
    return ClosingPlanner(constraint.matcher, len(tokenizer), compiled.stop_token_ids, compiled.closing)


def test_a_plan_finishes_the_json_and_leaves_the_matcher_as_it_was(engine, tokenizer):
    compiled = engine.grammars.prepare(_format(FORMAT))
    constraint = compiled.constraint()
    prefix = '{"tags": ["a", "bc'
    for t in tokenizer.encode(prefix, add_special_tokens=False):
        constraint.advance(t)
    planner = _planner(compiled, constraint, tokenizer)
    plan = planner.plan(HORIZON)
    assert plan is not None and 0 < len(plan) <= HORIZON
    text = tokenizer.decode(plan)
    assert schema_valid(prefix + text, SCHEMA), text
    assert len(plan) < len(text)  # written with the tokenizer's longer tokens, not one character each
    assert planner.plan(HORIZON) == plan  # rolled back: the same state plans the same way
    assert planner.plan(len(plan) - 1) is None  # not within fewer tokens (this greedy way)
    for t in plan:
        constraint.advance(t)
    assert planner.plan(HORIZON) == [] and planner.stop_token() in compiled.stop_token_ids  # it may stop now


def _format(response_format: dict):
    from kvboost.decoding.grammar import parse_output_format

    return parse_output_format(response_format)


def _shortest(engine, tokenizer) -> int:
    """Tokens of the shortest output the planner writes for FORMAT from its start."""
    compiled = engine.grammars.prepare(_format(FORMAT))
    constraint = compiled.constraint()
    return len(_planner(compiled, constraint, tokenizer).plan(HORIZON))


@pytest.mark.parametrize("extra", [0, 3, 9, 30])
def test_outputs_cut_by_max_new_tokens_still_parse(engine, tokenizer, extra):
    """Whenever the budget holds the shortest output, the output parses; a forced closing reports "length"."""
    budget = _shortest(engine, tokenizer) + extra
    forced = 0
    for seed in range(3):
        prompt = text_with_tokens(engine.tokenizer, 30, seed=seed)
        r = engine.generate(prompt, budget, response_format=FORMAT)
        assert schema_valid(r.output_text, SCHEMA), r.output_text
        assert r.generated_tokens <= budget
        forced += r.finish_reason == "length"
    assert forced  # the random model never finishes this object on its own within these budgets


def test_a_budget_below_the_shortest_output_is_cut_as_before(engine, tokenizer):
    r = engine.generate(text_with_tokens(engine.tokenizer, 30, seed=1), _shortest(engine, tokenizer) - 1,
                        response_format=FORMAT)
    assert not schema_valid(r.output_text, SCHEMA) and r.finish_reason == "length"


def test_closing_touches_only_the_budgets_last_tokens(engine):
    """Forced tokens come only in the last HORIZON tokens of a budget: a longer budget agrees on what comes before."""
    prompt = text_with_tokens(engine.tokenizer, 30, seed=5)
    short = engine.generate(prompt, HORIZON + 16, response_format=FORMAT)
    long = engine.generate(prompt, HORIZON + 120, response_format=FORMAT)
    assert short.output_token_ids[:16] == long.output_token_ids[:16]
    assert schema_valid(short.output_text, SCHEMA) and schema_valid(long.output_text, SCHEMA)


def test_batched_and_sampled_rows_close_too(engine):
    prompts = [text_with_tokens(engine.tokenizer, 30, seed=s) for s in range(3)]
    budget = _shortest(engine, engine.tokenizer) + 5
    for r in engine.generate_batch(prompts, max_new_tokens=budget, response_format=FORMAT):
        assert schema_valid(r.output_text, SCHEMA), r.output_text
    r = engine.generate(prompts[0], budget, response_format=FORMAT, temperature=1.0, seed=4)
    assert schema_valid(r.output_text, SCHEMA), r.output_text


def test_without_a_budget_nothing_is_forced(engine, tokenizer):
    compiled = engine.grammars.prepare(_format(FORMAT))
    import torch

    constraint = compiled.constraint()  # no budget: the bench's mask-overhead measurement
    logits = torch.zeros(len(tokenizer))
    allowed = torch.isfinite(constraint.mask(logits)).sum().item()
    assert allowed > 1 and constraint.forced == 0


def test_an_output_finished_near_the_budget_is_not_reported_as_cut(engine, tokenizer):
    """With the JSON complete and a few tokens left, nothing is forced: the constraint has nothing to close."""
    compiled = engine.grammars.prepare(_format(FORMAT))
    text = '{"tags":[],"note":"x","n":1}'
    ids = tokenizer.encode(text, add_special_tokens=False)
    constraint = compiled.constraint(budget=len(ids) + 3)
    for t in ids:
        constraint.advance(t)
    import torch

    free = compiled.constraint()  # no budget: the grammar's own mask
    for t in ids:
        free.advance(t)
    masked = constraint.mask(torch.zeros(len(tokenizer)))
    assert torch.equal(torch.isfinite(masked), torch.isfinite(free.mask(torch.zeros(len(tokenizer)))))  # nothing forced
    assert constraint.forced == 0 and not constraint.closing_started
