"""Request: the keyword API validated once, the context checked (refused, never cut), one result builder."""
from __future__ import annotations

import pytest

from kvboost import ContextLengthError, GenerationMode, InvalidRequestError, KVBoost
from kvboost.request import Request
from kvboost.sampling import SamplingParams

from .tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def engine(tokenizer):
    return KVBoost(make_tiny_model("llama", tokenizer), tokenizer, chunk_size=16)


def test_request_resolves_the_engine_defaults(engine):
    r = engine.request("hello there", 5, temperature=0.5, stop="\n", cache_salt="t1")
    assert isinstance(r, Request) and r.ids == engine.encode("hello there") and r.prompt_text == "hello there"
    assert r.params.max_new_tokens == 5 and r.params.stop == ["\n"] and r.salt == "t1"
    assert r.mode is GenerationMode.CHUNK_KV_REUSE and r.content_reuse is False and r.uses_cache
    assert engine.request("x", 2, content_reuse=True, mode="prefix_cache").approximate is False
    assert engine.request("x", 2, content_reuse=True).approximate is True


@pytest.mark.parametrize("kwargs, param", [
    (dict(cache_salt=3), "cache_salt"), (dict(content_reuse="yes"), "content_reuse"), (dict(mode="fast"), "mode"),
])
def test_bad_request_options_name_their_parameter(engine, kwargs, param):
    with pytest.raises(InvalidRequestError) as info:
        engine.request("hello", 4, **kwargs)
    assert info.value.param == param


def test_unknown_keyword_is_a_type_error_in_every_entry_point(engine):
    with pytest.raises(TypeError):
        engine.generate("hello", 4, temprature=0.3)
    with pytest.raises(TypeError):
        engine.generate_batch(["hello"], 4, temprature=0.3)


def test_prompt_plus_max_new_tokens_over_the_context_is_refused_everywhere(engine):
    ids = engine.encode("word " * 40)
    room = engine.max_context - len(ids)
    assert room > 1
    for call in (lambda n: engine.generate(input_ids=ids, max_new_tokens=n),
                 lambda n: engine.generate_batch(input_ids=[ids], max_new_tokens=n),
                 lambda n: engine.generate_many(input_ids=[ids, ids], max_new_tokens=n)):
        with pytest.raises(ContextLengthError, match=f"at most {room} new tokens") as info:
            call(room + 1)
        assert info.value.param == "max_new_tokens"
    assert engine.generate(input_ids=ids, max_new_tokens=room).generated_tokens <= room


def test_batch_runner_checks_a_request_built_elsewhere(engine):
    from kvboost.scheduler import Scheduler

    ids = engine.encode("word " * 10)
    request = Request(ids, SamplingParams(max_new_tokens=engine.max_context), "w")
    with pytest.raises(ContextLengthError):
        Scheduler(engine).add(request)


def test_results_are_built_the_same_way_in_every_path(engine):
    single = engine.generate("The river bends twice.", 6)
    batched = engine.generate_batch(["The river bends twice."], 6)[0]
    for field in ("mode", "prompt", "output_text", "output_token_ids", "prompt_tokens", "finish_reason",
                  "generated_tokens"):
        assert getattr(single, field) == getattr(batched, field), field
    assert single.cached_tokens == single.exact_tokens and batched.cached_tokens == batched.exact_tokens


def test_engine_cache_salt_is_the_default_tenant(tokenizer):
    model = make_tiny_model("llama", tokenizer)
    tenant = KVBoost(model, tokenizer, chunk_size=16, cache_salt="acme")
    prompt = "The river bends twice before the old mill. " * 4
    tenant.warm(prompt)
    assert tenant.request(prompt, 2).salt == "acme" and tenant.request(prompt, 2, cache_salt="x").salt == "x"
    assert tenant.generate(prompt + " Why?", 2).exact_tokens > 16  # warmed under the same default tenant
    tenant.forget_workspace()
    assert tenant.generate(prompt + " Why?", 2, cache_salt="other").exact_tokens == 0
    with pytest.raises(ValueError, match="cache_salt"):
        KVBoost(model, tokenizer, cache_salt=5)


def test_prompt_text_of_ids_and_messages_is_decoded_after_the_first_token(engine):
    """Decoding a long prompt back to text costs ms (17 ms at 30k tokens): it is deferred to the result, so TTFT
    never pays for it, and the result's prompt is the same text as before."""
    ids = engine.encode("the quick brown fox jumps over the lazy dog " * 4)
    assert engine.request(input_ids=ids, max_new_tokens=2).prompt_text is None
    messages = [{"role": "user", "content": "hi"}]
    assert engine.request(messages=messages, max_new_tokens=2).prompt_text is None
    assert engine.generate(input_ids=ids, max_new_tokens=2).prompt == engine.tokenizer.decode(ids)
    assert engine.generate(messages=messages, max_new_tokens=2).prompt == \
        engine.tokenizer.decode(engine.encode(messages=messages))
    assert engine.generate("plain text", 2).prompt == "plain text"
    batch = engine.generate_batch(input_ids=[ids, ids[:10]], max_new_tokens=2)
    assert [r.prompt for r in batch] == [engine.tokenizer.decode(ids), engine.tokenizer.decode(ids[:10])]
