"""Frequency / presence / repetition penalties and logit bias: their math, transformers' own processors as the
reference where it has one, and the same tokens in every path (single, stream, batch, speculative)."""
from __future__ import annotations

import pytest
import torch

from kvboost import InvalidRequestError, KVBoost
from kvboost.penalties import Penalties
from kvboost.sampling import Sampler, SamplingParams

from .decoding.test_speculative import _script
from .prompts import text_with_tokens
from .tiny_models import make_tiny_model

N = 24


@pytest.fixture(scope="module")
def model(tokenizer):
    return make_tiny_model("llama", tokenizer)


@pytest.fixture(scope="module")
def engine(model, tokenizer):
    return KVBoost(model, tokenizer, chunk_size=16)


@pytest.fixture(scope="module")
def ids(tokenizer):
    return tokenizer(text_with_tokens(tokenizer, 40, seed=5))["input_ids"]


def _hf(model, ids, **kwargs) -> list[int]:
    x = torch.tensor([ids], device=model.device)
    with torch.inference_mode():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=N, do_sample=False,
                             min_new_tokens=N, pad_token_id=0, **kwargs)
    return out[0, len(ids):].tolist()


def _reference_openai_penalties(model, ids, frequency, presence) -> list[int]:
    """OpenAI's formula written out: logit[j] - f * c[j] - p * (c[j] > 0) over generated tokens, full forwards."""
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(N):
            logits = model(torch.tensor([ids + out], device=model.device)).logits[0, -1].float()
            counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.shape[0]).float()
            counts = counts.to(logits.device)
            out.append(int(torch.argmax(logits - frequency * counts - presence * (counts > 0).float())))
    return out


def _kvb(engine, ids, **kwargs) -> list[int]:
    return list(engine.generate(input_ids=ids, max_new_tokens=N, stop=None, **kwargs).output_token_ids)


def test_penalty_math_on_a_small_vocabulary():
    pen = Penalties(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25, repetition_penalty=2.0,
                                   logit_bias={3: -10.0}), prompt_ids=[0])
    logits = torch.tensor([4.0, -2.0, 1.0, 3.0])
    first = pen.apply(logits)
    assert torch.equal(first, torch.tensor([2.0, -2.0, 1.0, -7.0]))  # token 0 seen in the prompt: 4 / 2
    pen.record(1)
    pen.record(1)
    second = pen.apply(logits)
    # token 1: repetition (-2 * 2), then two occurrences: -4 - 2 * 0.5 - 0.25
    assert torch.equal(second, torch.tensor([2.0, -5.25, 1.0, -7.0]))
    assert torch.equal(logits, torch.tensor([4.0, -2.0, 1.0, 3.0]))  # the caller's row is untouched


def test_a_sampler_with_penalties_is_not_plain():
    assert Sampler(SamplingParams()).plain
    for option in ({"frequency_penalty": 0.1}, {"presence_penalty": -0.1}, {"repetition_penalty": 1.1},
                   {"logit_bias": {"5": 1}}):
        assert not Sampler(SamplingParams(**option)).plain, option
    assert SamplingParams(logit_bias={"5": 1}).logit_bias == {5: 1.0}  # JSON keys become token ids


@pytest.mark.parametrize("option", [{"frequency_penalty": 2.1}, {"presence_penalty": float("nan")},
                                    {"repetition_penalty": 0.0}, {"repetition_penalty": -1},
                                    {"logit_bias": {"x": 1}}, {"logit_bias": {"²": 1}}, {"logit_bias": {1: 100.5}},
                                    {"logit_bias": [1]},
                                    {"frequency_penalty": True}])
def test_bad_values_are_typed_errors(engine, ids, option):
    with pytest.raises(InvalidRequestError) as info:
        engine.generate(input_ids=ids, max_new_tokens=2, **option)
    assert info.value.param == next(iter(option))


def test_a_biased_token_outside_the_vocabulary_is_refused(engine, ids):
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        engine.generate(input_ids=ids, max_new_tokens=2, logit_bias={10**7: 1})


def test_repetition_penalty_matches_transformers(model, engine, ids):
    plain = _kvb(engine, ids)
    got = _kvb(engine, ids, repetition_penalty=1.5)
    assert got == _hf(model, ids, repetition_penalty=1.5)
    assert got != plain  # a random model repeats itself: the penalty must have changed something


def test_logit_bias_matches_transformers_sequence_bias(model, engine, ids):
    plain = _kvb(engine, ids)
    bias = {plain[3]: -5.0, 17: 4.0}
    got = _kvb(engine, ids, logit_bias=bias)
    assert got == _hf(model, ids, sequence_bias={(t,): b for t, b in bias.items()})
    assert got != plain
    assert set(_kvb(engine, ids, logit_bias={"42": 100})) == {42}


def test_frequency_and_presence_penalties_follow_openai(model, engine, ids):
    plain = _kvb(engine, ids)
    got = _kvb(engine, ids, frequency_penalty=1.5, presence_penalty=0.5)
    assert got == _reference_openai_penalties(model, ids, 1.5, 0.5)
    assert got != plain
    assert _kvb(engine, ids, frequency_penalty=-2.0, presence_penalty=-2.0) == \
        _reference_openai_penalties(model, ids, -2.0, -2.0)


OPTIONS = {"frequency_penalty": 1.0, "presence_penalty": 0.3, "repetition_penalty": 1.2, "logit_bias": {"9": 2.0}}


def test_every_path_honours_the_penalties(engine, ids, tokenizer):
    single = _kvb(engine, ids, **OPTIONS)
    assert single == _kvb(engine, ids, **OPTIONS)  # a second run reuses the cache: same tokens
    stream = engine.generate_stream(input_ids=ids, max_new_tokens=N, **OPTIONS)
    text = "".join(stream)
    assert list(stream.result.output_token_ids) == single and text == stream.result.output_text
    other = tokenizer(text_with_tokens(tokenizer, 30, seed=9))["input_ids"]
    rows = engine.generate_batch(input_ids=[ids, other], max_new_tokens=N, **OPTIONS)
    assert list(rows[0].output_token_ids) == single
    assert list(rows[1].output_token_ids) == _kvb(engine, other, **OPTIONS)


@pytest.mark.parametrize("sampled", [False, True])
def test_speculation_keeps_penalized_output_identical(engine, ids, sampled, monkeypatch):
    """Drafts are verified position by position through the sampler (its counts advance per emitted token), so
    speculation changes nothing - greedy, and sampled with a seed (one draw per emitted token either way). The
    proposer knows the right output and corrupts half its proposals: kept, rejected and partly kept bursts."""
    extra = {"temperature": 0.8, "seed": 3} if sampled else {}
    off = _kvb(engine, ids, speculative="off", **OPTIONS, **extra)
    _script(monkeypatch, off, wrong=0.5)
    on = engine.generate(input_ids=ids, max_new_tokens=N, speculative="prompt_lookup", **OPTIONS, **extra)
    assert list(on.output_token_ids) == off
    assert 0 < on.accepted_tokens < on.draft_tokens  # drafts were verified, some kept and some rejected
