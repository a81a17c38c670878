"""content_reuse is honoured in every path: generate, generate_batch, generate_many and Scheduler rows give
the same tokens and the same exact / approximate / recomputed counts, given the same stored chunks."""
from __future__ import annotations

import pytest

from kvboost import GenerationMode, KVBoost
from kvboost.sampling import SamplingParams
from kvboost.scheduler import Scheduler

from ..reuse._rag import CHUNK, documents, rag_prompt
from ..tiny_models import make_tiny_model

INTRO = "Intro: read these notes.\n\n"
ORDERS = ([2, 0, 1], [1, 2, 0], [0, 2])


def _engine(model, tokenizer, **options) -> KVBoost:
    """Every document warmed alone (position 0), and the prompts' intro, so the store holds the same chunks
    whichever request runs first: nothing a request writes back changes what the next one finds."""
    engine = KVBoost(model, tokenizer, chunk_size=CHUNK, **options)
    for doc in documents():
        engine.warm(doc)
    engine.warm(INTRO)
    return engine


def _counts(r) -> tuple[int, int, int, int]:
    return r.exact_tokens, r.approximate_tokens, r.recomputed_tokens, r.cached_tokens


@pytest.fixture(scope="module")
def model_and_tokenizer(tokenizer):
    return make_tiny_model("llama", tokenizer), tokenizer


@pytest.fixture(scope="module")
def singles(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    engine = _engine(model, tokenizer)
    prompts = [rag_prompt(documents(), order) for order in ORDERS]
    results = [engine.generate(p, 6, content_reuse=True) for p in prompts]
    assert all(r.approximate_tokens > 0 for r in results), "the documents must be found at their new positions"
    return prompts, results


@pytest.mark.parametrize("path", ["generate_batch", "generate_many"])
def test_batches_match_generate_one_at_a_time(model_and_tokenizer, singles, path):
    model, tokenizer = model_and_tokenizer
    prompts, expected = singles
    got = getattr(_engine(model, tokenizer), path)(prompts, 6, content_reuse=True)
    for want, have in zip(expected, got):
        assert have.output_token_ids == want.output_token_ids
        assert _counts(have) == _counts(want)


def test_engine_default_applies_to_batches_and_can_be_turned_off_per_call(model_and_tokenizer, singles):
    model, tokenizer = model_and_tokenizer
    prompts, expected = singles
    engine = _engine(model, tokenizer, content_reuse=True)
    assert [_counts(r) for r in engine.generate_batch(prompts, 6)] == [_counts(r) for r in expected]
    off = engine.generate_batch(prompts, 6, content_reuse=False)
    assert all(r.approximate_tokens == 0 for r in off)
    plain = _engine(model, tokenizer).generate_batch(prompts, 6)
    assert [r.output_token_ids for r in off] == [r.output_token_ids for r in plain]


def test_a_content_row_decodes_beside_exact_rows(model_and_tokenizer, singles):
    """A row that joins a running batch with content reuse gets its own placement; the others are unaffected."""
    model, tokenizer = model_and_tokenizer
    prompts, expected = singles
    engine = _engine(model, tokenizer)
    exact_prompt = INTRO + "Question: what is a river?"
    exact_alone = _engine(model, tokenizer).generate(exact_prompt, 6)
    runner = Scheduler(engine, max_batch_size=4)
    plain = runner.add(engine.encode(exact_prompt), SamplingParams(max_new_tokens=6), exact_prompt)
    runner.step()
    rag = runner.add(engine.encode(prompts[0]), SamplingParams(max_new_tokens=6), prompts[0], content_reuse=True)
    while runner.has_work():
        runner.step()
    assert plain.result.output_token_ids == exact_alone.output_token_ids and plain.result.approximate_tokens == 0
    assert rag.result.output_token_ids == expected[0].output_token_ids
    assert _counts(rag.result) == _counts(expected[0])


def test_nothing_approximate_is_written_back_from_a_batch(model_and_tokenizer, singles):
    model, tokenizer = model_and_tokenizer
    prompts, _ = singles
    engine = _engine(model, tokenizer)
    results = engine.generate_batch(prompts, 6, content_reuse=True)
    assert all(r.approximate_tokens > 0 for r in results)
    # Placed K/V (and everything computed after it) never enters the prefix chain: an exact lookup of the same
    # prompt afterwards finds no more than the exact prefix the batch used.
    for prompt, r in zip(prompts, results):
        exact_now = engine.kv.lookup(engine.encode(prompt), None, GenerationMode.CHUNK_KV_REUSE).reuse_len
        assert exact_now == r.exact_tokens
