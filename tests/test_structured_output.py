"""Constrained decoding through the engine: single, streamed and batched rows; EOS, stop strings, logprobs, reuse."""
from __future__ import annotations

import json

import pytest

from kvboost import InvalidRequestError, KVBoost
from kvboost.decoding.grammar import GrammarError

from .prompts import text_with_tokens
from .tiny_models import make_tiny_eos_model

pytest.importorskip("xgrammar")

# Only bounded values: even a random model must finish this object within the budget.
SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                           "n": {"type": "integer", "minimum": 1, "maximum": 99},
                                           "ok": {"type": "boolean"}},
          "required": ["color", "n", "ok"]}
FORMAT = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}


def valid(text: str) -> bool:
    from benchmarks.structured import schema_valid

    return schema_valid(text, SCHEMA)


@pytest.fixture(scope="module")
def engine(tokenizer):
    return KVBoost(make_tiny_eos_model("llama", tokenizer), tokenizer, chunk_size=16)


def test_random_model_output_matches_the_schema(engine):
    for seed in range(3):
        prompt = text_with_tokens(engine.tokenizer, 40, seed=seed)
        free = engine.generate(prompt, 60)
        r = engine.generate(prompt, 300, response_format=FORMAT)
        assert not valid(free.output_text)  # the random model alone never writes this JSON
        assert valid(r.output_text), r.output_text
        assert r.finish_reason == "stop"  # EOS as soon as the grammar allows it (nothing else is allowed then)


def test_sampled_streamed_and_regex_grammar_formats(engine):
    prompt = text_with_tokens(engine.tokenizer, 30, seed=7)
    r = engine.generate(prompt, 300, response_format=FORMAT, temperature=1.0, seed=3)
    assert valid(r.output_text)
    assert "".join(engine.generate_stream(prompt, 300, response_format=FORMAT)) == \
        engine.generate(prompt, 300, response_format=FORMAT).output_text
    assert engine.generate(prompt, 20, regex=r"(yes|no)!").output_text in ("yes!", "no!")
    out = engine.generate(prompt, 20, grammar='root ::= "answer: " [0-9] [0-9]').output_text
    assert out.startswith("answer: ") and out[8:].isdigit() and len(out) == 10
    obj = engine.generate(prompt, 200, response_format={"type": "json_object"}, temperature=0.7, seed=1)
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.output_text), dict)
    else:  # cut by the budget: still a prefix the grammar allows
        assert obj.output_text.lstrip().startswith("{")


def test_stop_strings_compose_with_the_format(engine):
    prompt = text_with_tokens(engine.tokenizer, 30, seed=8)
    r = engine.generate(prompt, 60, response_format=FORMAT, stop=['"n"'])
    assert r.finish_reason == "stop" and '"n"' not in r.output_text and r.output_text.startswith("{")


def test_batch_rows_each_follow_their_grammar(engine):
    prompts = [text_with_tokens(engine.tokenizer, 40, seed=s) for s in (11, 12, 13)]
    rows = engine.generate_batch(prompts, 300, response_format=FORMAT)
    assert all(valid(r.output_text) for r in rows)
    singles = [engine.generate(p, 300, response_format=FORMAT) for p in prompts]
    assert [r.output_token_ids for r in rows] == [r.output_token_ids for r in singles]
    mixed = engine.run_batch([engine.request(prompts[0], 300, response_format=FORMAT),
                              engine.request(prompts[1], 12),
                              engine.request(prompts[2], 20, regex="[a-c]{4}")])
    assert valid(mixed[0].output_text) and mixed[2].output_text and set(mixed[2].output_text) <= set("abc")
    assert mixed[1].output_token_ids == engine.generate(prompts[1], 12).output_token_ids


def test_greedy_without_format_is_unchanged_and_reuse_is_undisturbed(engine):
    prompt = text_with_tokens(engine.tokenizer, 64, seed=21)
    engine.clear_cache()
    plain = engine.generate(prompt, 16)
    fmt = engine.generate(prompt, 16, response_format=FORMAT)
    assert fmt.cached_tokens == plain.prompt_tokens - 1 or fmt.cached_tokens >= 48
    engine.forget_workspace()  # from the store this time, not the resident workspace prefix
    again = engine.generate(prompt, 16)
    assert again.output_token_ids == plain.output_token_ids
    assert again.cached_tokens == fmt.cached_tokens > 0


def test_logprobs_are_reported_per_output_token(engine):
    import torch

    prompt = text_with_tokens(engine.tokenizer, 30, seed=5)
    r = engine.generate(prompt, 8, logprobs=3, return_logits=True)
    assert [t.token for t in r.logprobs] == r.output_token_ids
    first = r.logprobs[0]
    logp = torch.log_softmax(r.first_token_logits.float(), -1)
    assert first.logprob == pytest.approx(float(logp[first.token]), abs=1e-5)
    assert [t for t, _ in first.top] == torch.topk(logp, 3).indices.tolist()
    rows = engine.generate_batch([prompt, prompt + " x"], 8, logprobs=0)
    assert all(len(x.logprobs) == x.generated_tokens and x.logprobs[0].top == [] for x in rows)
    assert engine.generate(prompt, 8).logprobs is None
    with pytest.raises(InvalidRequestError):
        engine.generate(prompt, 8, logprobs=21)


def test_bad_schema_is_a_typed_error_before_anything_runs(engine):
    with pytest.raises(GrammarError, match="cannot be compiled") as info:
        engine.generate("hi", 8, response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/missing"}}}}})
    assert info.value.param == "response_format.json_schema.schema"
    with pytest.raises(InvalidRequestError):
        engine.generate("hi", 8, regex="a", grammar='root ::= "a"')
    with pytest.raises(GrammarError):
        engine.generate_batch(["hi", "ho"], 8, regex="(")


@pytest.mark.slow
def test_smollm2_json_schema_and_reuse(smol, device):
    model, tok = smol
    engine = KVBoost(model, tok, chunk_size=16)
    person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"]}
    messages = [{"role": "system", "content": "You are a helpful assistant that answers with data. " * 3},
                {"role": "user", "content": "Describe Alice, who is 30, as JSON with her name and age."}]
    plain = engine.generate(messages=messages, max_new_tokens=24)
    r = engine.generate(messages=messages, max_new_tokens=60,
                        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": person}})
    data = json.loads(r.output_text)
    assert set(data) == {"name", "age"} and 0 <= data["age"] <= 120 and r.finish_reason == "stop"
    assert r.cached_tokens > 0 and r.cached_tokens == plain.prompt_tokens - 1 or r.cached_tokens >= 16
