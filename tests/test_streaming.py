"""generate_stream deltas, stop strings, EOS, messages, cache stats, salts."""
from __future__ import annotations

import pytest

from kvboost import KVBoost

from .prompts import text_with_tokens, words
from .tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def engine(tokenizer):
    return KVBoost(make_tiny_model("llama", tokenizer), tokenizer, chunk_size=16)


def test_stream_deltas_join_to_the_full_text(engine):
    prompt = text_with_tokens(engine.tokenizer, 40, seed=2)
    full = engine.generate(prompt, 20)
    stream = engine.generate_stream(prompt, 20)
    deltas = list(stream)
    assert "".join(deltas) == full.output_text
    assert stream.result.output_token_ids == full.output_token_ids


def test_stop_string_truncates_and_reports_stop(engine):
    prompt = text_with_tokens(engine.tokenizer, 40, seed=3)
    full = engine.generate(prompt, 24)
    assert len(full.output_text) > 6
    stop = full.output_text[3:6]
    cut = engine.generate(prompt, 24, stop=[stop])
    assert cut.finish_reason == "stop"
    assert cut.output_text == full.output_text[: full.output_text.find(stop)]
    streamed = "".join(engine.generate_stream(prompt, 24, stop=stop))
    assert streamed == cut.output_text


def test_closing_a_stream_stops_generation_and_engine_recovers(engine):
    prompt = text_with_tokens(engine.tokenizer, 40, seed=4)
    stream = engine.generate_stream(prompt, 200)
    next(iter(stream))
    stream.close()
    assert engine.generate(prompt, 5).generated_tokens > 0


def test_eos_token_ends_generation(tokenizer):
    model = make_tiny_model("llama", tokenizer)
    engine = KVBoost(model, tokenizer, chunk_size=16)
    prompt = text_with_tokens(tokenizer, 30, seed=5)
    first = engine.generate(prompt, 4).output_token_ids[0]
    engine.eos_token_ids = {first}  # the model's favourite first token now ends generation at once
    result = engine.generate(prompt, 10)
    assert result.generated_tokens == 0 and result.finish_reason == "stop"


def test_cache_salt_isolates_tenants(engine):
    prompt = text_with_tokens(engine.tokenizer, 64, seed=6)
    engine.clear_cache()
    engine.generate(prompt, 2, cache_salt="tenant-a")
    engine.forget_workspace()
    other = engine.generate(prompt, 2, cache_salt="tenant-b")
    assert other.cached_tokens == 0
    engine.forget_workspace()
    same = engine.generate(prompt, 2, cache_salt="tenant-a")
    assert same.cached_tokens > 0
    # The workspace's resident prefix is also per tenant.
    assert engine.generate(prompt, 2, cache_salt="tenant-c").cached_tokens == 0


def test_cache_stats_and_warm_result(engine):
    engine.clear_cache()
    warm = engine.warm(words(60, seed=9))
    assert warm and warm.chunks_stored >= 2
    again = engine.warm(words(60, seed=9))
    assert again.chunks_stored == 0 and again.chunks_already_cached == warm.chunks_stored
    stats = engine.cache_stats()
    assert stats["tiers"]["memory"]["entries"] >= warm.chunks_stored
    assert stats["tiers"]["memory"]["bytes"] > 0 and "avg_lookup_ms" in stats


def test_short_warm_warns(engine):
    w = engine.warm("hello there")
    assert w.warnings and "partial" in w.warnings[0]
