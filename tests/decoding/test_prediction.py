"""Predicted outputs (OpenAI's `prediction`): drafts come from the predicted text first; the output is exactly the
output without a prediction, whether the prediction is right, partly right or wrong."""
from __future__ import annotations

import pytest

from kvboost import InvalidRequestError, KVBoost

from ..prompts import text_with_tokens
from ..tiny_models import make_tiny_model

N = 32


@pytest.fixture(scope="module")
def engine(tokenizer):
    return KVBoost(make_tiny_model("llama", tokenizer), tokenizer, chunk_size=16)  # speculative off by default


@pytest.fixture(scope="module")
def prompt(tokenizer):
    return text_with_tokens(tokenizer, 40, seed=12)


def test_a_right_prediction_is_kept_and_changes_nothing(engine, prompt):
    plain = engine.generate(prompt, N)
    assert plain.draft_tokens == 0  # the engine does not speculate by default
    predicted = engine.generate(prompt, N, prediction=list(plain.output_token_ids))
    assert predicted.output_token_ids == plain.output_token_ids
    assert predicted.speculative == "prompt_lookup"
    assert predicted.accepted_tokens >= N // 2  # the prediction is the output: long runs are kept
    as_text = engine.generate(prompt, N, prediction=plain.output_text)
    assert as_text.output_token_ids == plain.output_token_ids and as_text.accepted_tokens > 0


@pytest.mark.parametrize("how", ["partly", "wrong"])
def test_a_partly_right_or_wrong_prediction_changes_nothing(engine, prompt, tokenizer, how):
    plain = engine.generate(prompt, N)
    truth = list(plain.output_token_ids)
    if how == "partly":  # right at the start, then every 5th token replaced
        guess = [t if i % 5 else (t + 7) % 1000 + 3 for i, t in enumerate(truth)]
    else:
        guess = tokenizer(text_with_tokens(tokenizer, N, seed=99))["input_ids"]
    # Drafts from a 1-token match: with "auto" the engine needs a 2-token match wherever its measured verify cost is
    # high (a busy machine), and a wrong guess may then never be drafted from at all.
    out = engine.generate(prompt, N, prediction=guess, prompt_lookup_min_ngram=1)
    assert out.output_token_ids == plain.output_token_ids
    assert out.draft_tokens > 0
    stream = engine.generate_stream(prompt, N, prediction=guess)
    assert "".join(stream) == plain.output_text


def test_contradicting_or_bad_predictions_are_typed_errors(engine, prompt):
    for speculative in ("off", None):
        with pytest.raises(InvalidRequestError) as info:
            engine.generate(prompt, 4, prediction="hello", speculative=speculative)
        assert info.value.param == "prediction"
    with pytest.raises(InvalidRequestError) as info:
        engine.generate(prompt, 4, prediction=[1, 10**9])
    assert info.value.param == "prediction"
    with pytest.raises(InvalidRequestError):
        engine.generate(prompt, 4, prediction=3.5)
    with pytest.raises(TypeError, match="prediction"):  # a batch shares options: one prediction cannot fit all rows
        engine.generate_batch([prompt, prompt], 4, prediction="hello")
    assert engine.generate(prompt, 4, prediction="").draft_tokens == 0  # empty: nothing to draft from
