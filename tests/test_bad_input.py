"""Bad input raises a clear ValueError subclass, and the engine keeps working afterwards."""
from __future__ import annotations

import pytest

from kvboost import ContextLengthError, InvalidRequestError, KVBoost

from .tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def engine(tokenizer):
    return KVBoost(make_tiny_model("llama", tokenizer), tokenizer, chunk_size=16)


@pytest.mark.parametrize("kwargs, match", [
    (dict(prompt=""), "empty"),
    (dict(prompt=None), "string or a list of messages"),
    (dict(prompt=123), "string or a list of messages"),
    (dict(prompt="hi", max_new_tokens=0), "max_new_tokens"),
    (dict(prompt="hi", max_new_tokens=-3), "max_new_tokens"),
    (dict(prompt="hi", max_new_tokens=2.5), "max_new_tokens"),
    (dict(prompt="hi", temperature=-0.1), "temperature"),
    (dict(prompt="hi", temperature=float("nan")), "temperature"),
    (dict(prompt="hi", top_p=0.0), "top_p"),
    (dict(prompt="hi", top_k=-1), "top_k"),
    (dict(prompt="hi", mode="turbo"), "unknown mode"),
    (dict(prompt="hi", stop=[""]), "stop"),
    (dict(prompt="hi", seed="x"), "seed"),
    (dict(messages=[]), "messages"),
    (dict(messages=[{"content": "no role"}]), "role"),
    (dict(prompt="hi", messages=[{"role": "user", "content": "x"}]), "either prompt or messages"),
    (dict(input_ids=[]), "input_ids is empty"),
    (dict(input_ids=[1, 10**9]), r"input_ids\[1\] = 1000000000 is outside the model's vocabulary"),
    (dict(input_ids=[1, -1]), "outside the model's vocabulary"),
    (dict(input_ids=[1, 2.0]), "must be integers"),
    (dict(input_ids=[True, 2]), "must be integers"),
    (dict(input_ids="1 2 3"), "sequence of integer token ids"),
    (dict(input_ids=[1, 2], prompt="hi"), "one of prompt, messages or input_ids"),
])
def test_bad_arguments_raise_value_error(engine, kwargs, match):
    with pytest.raises(ValueError, match=match) as info:
        engine.generate(**kwargs)
    assert isinstance(info.value, InvalidRequestError)
    assert engine.generate("still working", 3).generated_tokens >= 0


def test_prompt_longer_than_context(engine):
    too_long = "word " * (engine.max_context + 10)
    with pytest.raises(ContextLengthError, match="context"):
        engine.generate(too_long, 4)
    with pytest.raises(ContextLengthError):
        engine.warm(too_long)
    assert engine.generate("still working", 3).prompt_tokens > 0


def test_prompt_plus_max_new_tokens_past_the_context_is_refused(engine):
    # As OpenAI answers 400: asking for more tokens than the context has room for is an error, not a silent cut.
    ids_per_word = len(engine.encode("word " * 100)) / 100
    n_words = int((engine.max_context - 3) / ids_per_word)
    prompt = "word " * n_words
    free = engine.max_context - len(engine.encode(prompt))
    if free <= 0:
        pytest.skip("tokenization made the prompt fill the context")
    with pytest.raises(ContextLengthError, match=f"ask for at most {free} new tokens") as info:
        engine.generate(prompt, 50)
    assert info.value.param == "max_new_tokens"
    result = engine.generate(prompt, free)  # exactly what fits
    assert result.generated_tokens <= free and result.prompt_tokens + free == engine.max_context


def test_bad_engine_options(tokenizer):
    model = make_tiny_model("llama", tokenizer)
    for kwargs, match in [(dict(chunk_size=3), "chunk_size"), (dict(kv_cache_bits=5), "kv_cache_bits"),
                          (dict(recompute_strategy="magic"), "recompute_strategy"),
                          (dict(recompute_ratio=1.5), "recompute_ratio")]:
        with pytest.raises(ValueError, match=match):
            KVBoost(model, tokenizer, **kwargs)
    with pytest.raises(TypeError, match="unknown engine option"):
        KVBoost(model, tokenizer, chunk_sise=64)


def test_warm_position_offset_rejected(engine):
    with pytest.raises(ValueError, match="position_offset"):
        engine.warm("some text", position_offset=5)
