"""generate()'s own per-request options through the server (extra_body): speculation, mode and content_reuse are
honoured on either worker (a batching one verifies prompt-lookup rows' drafts in its steps) or refused
with a 400 naming the field - never silently ignored."""
from __future__ import annotations

import openai
import pytest

from kvboost import KVBoost

from ..tiny_models import make_tiny_model
from .conftest import TINY_NAME, live_server

PROMPT = "river stone lantern quiet orbit " * 6


@pytest.fixture(scope="module")
def engine(tokenizer):
    return KVBoost(make_tiny_model("llama", tokenizer), tokenizer, chunk_size=16)  # no speculation by default


def _complete(live, **extra):
    return live.client().completions.create(model=TINY_NAME, prompt=PROMPT, max_tokens=24, temperature=0,
                                            extra_body=extra or None)


@pytest.mark.parametrize("max_batch_size", [4, 1], ids=["batched", "single"])
def test_speculation_per_request_is_honoured_with_the_same_reply(engine, tiny_model_dir, max_batch_size):
    want = engine.generate(PROMPT, 24, speculative="off").output_text
    drafted = engine.cache_stats()["speculative"]["draft_tokens"]
    with live_server(engine, model=str(tiny_model_dir), max_batch_size=max_batch_size) as live:
        assert _complete(live).choices[0].text == want
        assert engine.cache_stats()["speculative"]["draft_tokens"] == drafted  # the engine's default: off
        r = _complete(live, speculative="prompt_lookup", num_speculative_tokens=4, prompt_lookup_min_ngram=1)
        assert r.choices[0].text == want
        assert engine.cache_stats()["speculative"]["draft_tokens"] > drafted


@pytest.mark.parametrize("extra,param", [({"speculative": "ngram"}, "speculative"),
                                         ({"speculative": "draft"}, "speculative"),  # no draft model loaded
                                         ({"speculative": "prompt_lookup", "num_speculative_tokens": 0},
                                          "num_speculative_tokens"),
                                         ({"num_speculative_tokens": "4"}, "num_speculative_tokens"),
                                         ({"mode": "fastest"}, "mode"),
                                         ({"content_reuse": "yes"}, "content_reuse")])
def test_bad_request_options_are_a_400_naming_the_field(engine, tiny_model_dir, extra, param):
    with live_server(engine, model=str(tiny_model_dir), max_batch_size=4) as live:
        with pytest.raises(openai.BadRequestError) as info:
            _complete(live, **extra)
    assert info.value.param == param


def test_speculative_null_turns_the_engines_speculation_off(tokenizer, tiny_model_dir):
    spec = KVBoost(make_tiny_model("llama", tokenizer), tokenizer, chunk_size=16, speculative="prompt_lookup")
    with live_server(spec, model=str(tiny_model_dir), max_batch_size=1) as live:
        off = live.client().chat.completions.create(model=TINY_NAME, messages=[{"role": "user", "content": PROMPT}],
                                                    max_tokens=16, temperature=0, extra_body={"speculative": None})
        assert spec.cache_stats()["speculative"]["draft_tokens"] == 0
        on = live.client().chat.completions.create(model=TINY_NAME, messages=[{"role": "user", "content": PROMPT}],
                                                   max_tokens=16, temperature=0)
        assert spec.cache_stats()["speculative"]["draft_tokens"] > 0
    assert off.choices[0].message.content == on.choices[0].message.content


@pytest.mark.parametrize("max_batch_size", [4, 1], ids=["batched", "single"])
def test_mode_per_request(engine, tiny_model_dir, max_batch_size):
    engine.warm(PROMPT)
    with live_server(engine, model=str(tiny_model_dir), max_batch_size=max_batch_size) as live:
        reused = _complete(live)
        baseline = _complete(live, mode="baseline")
    assert reused.usage.prompt_tokens_details.cached_tokens >= 16
    assert baseline.usage.prompt_tokens_details.cached_tokens == 0
    assert baseline.choices[0].text == reused.choices[0].text
