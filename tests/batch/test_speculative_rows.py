"""Prompt-lookup rows in the continuous-batching runner: a row alone verifies drafts as generate() does, rows
together verify theirs in ragged steps; every output equals plain generation, and what a row stores is what plain
generation would store."""
from __future__ import annotations

import pytest

from kvboost import KVBoost
from kvboost.scheduler import Scheduler

from ..prompts import text_with_tokens
from ..tiny_models import make_tiny_model

# Repetitive text: prompt lookup finds drafts in it, and a tiny random model tends to copy it.
REPEATED = "river stone lantern quiet orbit " * 6


def _run(runner: Scheduler, handles) -> list:
    while runner.has_work():
        runner.step()
    for h in handles:
        assert h.error is None, h.error
    return [h.result for h in handles]


@pytest.fixture(params=["off", "eager"])
def engines(request, tokenizer):
    """(plain, spec): the same tiny model, without and with prompt lookup; fast_path "eager" runs the runner's
    fixed-shape steps (its verify bucket), "off" the batch's own forward."""
    model = make_tiny_model("llama", tokenizer)
    plain = KVBoost(model, tokenizer, chunk_size=16)
    spec = KVBoost(model, tokenizer, chunk_size=16, speculative="prompt_lookup", fast_path=request.param)
    return plain, spec


def test_a_row_alone_verifies_drafts_and_equals_plain_generation(engines):
    plain, spec = engines
    want = plain.generate(REPEATED, 40)
    runner = Scheduler(spec, max_batch_size=4)
    [got] = _run(runner, [runner.add(spec.request(REPEATED, 40))])
    assert got.output_token_ids == want.output_token_ids and got.output_text == want.output_text
    assert got.speculative == "prompt_lookup"
    assert got.draft_tokens > 0 and got.accepted_tokens > 0  # it really verified, and kept some
    stats = spec.cache_stats()["speculative"]
    assert stats["draft_tokens"] == got.draft_tokens and stats["accepted_tokens"] == got.accepted_tokens


def test_rows_verify_drafts_together_in_ragged_steps(engines, tokenizer):
    """Three rows of different lengths verify their drafts together (a ragged step: each row its own number of
    drafts, padded to the widest); rows leave in the middle of such steps. Outputs equal plain generation's, row by
    row."""
    plain, spec = engines
    prompts = [REPEATED, text_with_tokens(tokenizer, 30, seed=3) + " " + REPEATED, text_with_tokens(tokenizer, 20)]
    lengths = [48, 8, 12]
    want = [plain.generate(p, n).output_token_ids for p, n in zip(prompts, lengths)]
    runner = Scheduler(spec, max_batch_size=4)
    handles = [runner.add(spec.request(p, n)) for p, n in zip(prompts, lengths)]
    steps_together = 0
    while runner.has_work():
        steps_together += runner.active_count() > 1
        runner.step()
    got = [h.result for h in handles]
    assert [r.output_token_ids for r in got] == want
    assert steps_together >= 5  # the short rows ran beside the long one
    assert runner.speculation.drafting.verifies > 0  # ...and verified drafts with it
    if runner.runner is not None:  # fixed-shape steps: the runner's batched verify (CUDA graphs on a GPU)
        assert any(key[0] == "rows_verify" for key in runner.runner.steps)
    assert got[1].draft_tokens > 0  # the shortest row drafted although it never ran alone
    stats = spec.cache_stats()["speculative"]
    assert stats["draft_tokens"] == sum(r.draft_tokens for r in got)
    assert 0 < stats["batched_proposals"] <= stats["proposals"]


def test_a_row_without_speculation_rides_along_ragged_steps(engines, tokenizer):
    """A row that asked for no speculation takes one token per step, whatever width its company verifies at."""
    plain, spec = engines
    prompts = [REPEATED, text_with_tokens(tokenizer, 24, seed=5), REPEATED + " lantern"]
    want = [plain.generate(p, 24).output_token_ids for p in prompts]
    runner = Scheduler(spec, max_batch_size=4)
    handles = [runner.add(spec.request(p, 24, speculative=s)) for p, s in zip(prompts, ("prompt_lookup", "off",
                                                                                          "prompt_lookup"))]
    got = _run(runner, handles)
    assert [r.output_token_ids for r in got] == want
    assert runner.speculation.drafting.verifies > 0
    assert got[1].draft_tokens == 0 and got[1].speculative is None


def test_stops_inside_a_burst_and_the_stored_chunks_are_plain_generations(engines):
    """A stop string or max_new_tokens inside an accepted burst ends the output exactly there, and what the row
    wrote back serves a follow-up as plain generation's would (rejected drafts are never stored)."""
    plain, spec = engines
    base = plain.generate(REPEATED, 40).output_text
    stop = base[len(base) // 2: len(base) // 2 + 6]
    for options in ({"stop": [stop]}, {}):
        for n in (9, 23):
            want = plain.generate(REPEATED, n, **options)
            runner = Scheduler(spec, max_batch_size=2)
            [got] = _run(runner, [runner.add(spec.request(REPEATED, n, **options))])
            assert (got.output_text, got.finish_reason) == (want.output_text, want.finish_reason)
    # The same inside ragged steps, beside a row that drafts too.
    companion = REPEATED + " river stone"
    verifies = 0
    for options in ({"stop": [stop]}, {}):
        want = [plain.generate(REPEATED, 23, **options), plain.generate(companion, 30)]
        runner = Scheduler(spec, max_batch_size=2)
        got = _run(runner, [runner.add(spec.request(REPEATED, 23, **options)), runner.add(spec.request(companion,
                                                                                                       30))])
        assert [(g.output_text, g.finish_reason) for g in got] == [(w.output_text, w.finish_reason) for w in want]
        verifies += runner.speculation.drafting.verifies
    assert verifies > 0
    follow = REPEATED + base + " and then"
    plain.clear_cache()
    assert spec.generate(follow, 12, speculative="off").output_token_ids == plain.generate(follow, 12).output_token_ids
    assert spec.generate(follow, 1).cached_tokens > len(spec.tokenizer(REPEATED).input_ids)


def test_a_shared_prefix_row_speculates_over_the_cascade(tokenizer):
    """Rows sharing a stored prefix read it through cascade attention; the row left alone verifies over it. With a
    runner (CUDA graphs) a prefix this short is copied per row instead, so the fast path is off."""
    model = make_tiny_model("llama", tokenizer)
    plain = KVBoost(model, tokenizer, chunk_size=16, fast_path="off")
    spec = KVBoost(model, tokenizer, chunk_size=16, speculative="prompt_lookup", fast_path="off")
    shared = text_with_tokens(tokenizer, 64, seed=9)
    prompts = [shared + " " + REPEATED, shared + " lantern quiet"]
    lengths = [40, 6]
    want = [plain.generate(p, n).output_token_ids for p, n in zip(prompts, lengths)]
    spec.warm(shared)
    runner = Scheduler(spec, max_batch_size=2)
    handles = [runner.add(spec.request(p, n)) for p, n in zip(prompts, lengths)]
    runner.step()
    assert runner.prefix is not None and runner.prefix.length >= 48  # the rows read one shared prefix
    got = _run(runner, handles)
    assert [r.output_token_ids for r in got] == want
    assert got[0].draft_tokens > 0
    # Both rows long: they verify together over the shared prefix (cascade attention with a ragged step's mask).
    lengths = [30, 30]
    prompts[1] = shared + " " + REPEATED + " orbit"
    want = [plain.generate(p, n).output_token_ids for p, n in zip(prompts, lengths)]
    runner = Scheduler(spec, max_batch_size=2)
    handles = [runner.add(spec.request(p, n)) for p, n in zip(prompts, lengths)]
    runner.step()
    assert runner.prefix is not None
    got = _run(runner, handles)
    assert [r.output_token_ids for r in got] == want
    assert runner.speculation.drafting.verifies > 0


@pytest.mark.parametrize("options", [{"regex": r"(river|stone|lantern|quiet|orbit| )+"},
                                     {"repetition_penalty": 1.3, "logprobs": 2},
                                     {"temperature": 0.8}])
def test_masked_penalized_and_sampled_rows_speculate_like_generate(tokenizer, options):
    """A grammar, penalties and log-probabilities go through the same per-token sampling as generate()'s
    speculation; unseeded sampling joins the batch (its draws follow the target's distribution either way)."""
    pytest.importorskip("xgrammar") if "regex" in options else None
    model = make_tiny_model("llama", tokenizer)
    plain = KVBoost(model, tokenizer, chunk_size=16)
    spec = KVBoost(model, tokenizer, chunk_size=16, speculative="prompt_lookup")
    request = spec.request(REPEATED, 30, **options)
    runner = Scheduler(spec, max_batch_size=2)
    [got] = _run(runner, [runner.add(request)])
    # Beside a greedy row that drafts too: the same row verifies in ragged steps.
    runner = Scheduler(spec, max_batch_size=2)
    together = _run(runner, [runner.add(spec.request(REPEATED, 30, **options)), runner.add(spec.request(REPEATED,
                                                                                                        30))])
    assert runner.speculation.drafting.verifies > 0
    assert together[1].output_token_ids == plain.generate(REPEATED, 30).output_token_ids
    if "temperature" in options:
        assert got.generated_tokens == 30 or got.finish_reason == "stop"
        assert together[0].generated_tokens == 30 or together[0].finish_reason == "stop"
        return
    want = plain.generate(REPEATED, 30, **options)
    assert got.output_token_ids == want.output_token_ids
    assert together[0].output_token_ids == want.output_token_ids
    if "logprobs" in options:
        assert [lp.token for lp in together[0].logprobs] == [lp.token for lp in want.logprobs]
    if "logprobs" in options:
        assert [lp.token for lp in got.logprobs] == [lp.token for lp in want.logprobs]
        assert [lp.logprob for lp in got.logprobs] == pytest.approx([lp.logprob for lp in want.logprobs], abs=1e-4)


class _Truth:
    """A proposer that drafts what plain sampling emits for its request (known from a run without speculation): a
    sampler that draws as without speculation keeps every draft."""

    def __init__(self, truth: list[int], emitted: int):
        self.truth, self.emitted = truth, emitted

    def extend(self, tokens):
        self.emitted += len(tokens)

    def propose(self, k):
        return list(self.truth[self.emitted:self.emitted + k])

    def close(self, emitted):
        pass


def test_seeded_sampled_rows_speculate_and_draw_what_plain_sampling_draws(tokenizer, monkeypatch):
    """A sampled row's sampler draws once per emitted token whatever was drafted: a seeded speculative row gives
    the seeded non-speculative output, alone (generate) and verified beside other rows (generate_batch)."""
    from kvboost.decoding import factory

    spec = KVBoost(make_tiny_model("llama", tokenizer), tokenizer, chunk_size=16, speculative="prompt_lookup")
    prompts, seeds = [REPEATED, REPEATED + " orbit"], [3, 5]
    plain = {p: spec.generate(p, 24, temperature=0.8, seed=s, speculative="off").output_token_ids
             for p, s in zip(prompts, seeds)}
    ids = {tuple(spec.encode(p)): p for p in prompts}
    monkeypatch.setattr(factory, "make_proposer", lambda engine, request, context, costs=None: _Truth(
        plain[ids[tuple(request.ids)]], len(context) - len(request.ids)))
    alone = spec.generate(prompts[0], 24, temperature=0.8, seed=3)
    assert alone.output_token_ids == plain[prompts[0]] and alone.accepted_tokens > 0
    runner = Scheduler(spec, max_batch_size=3)
    got = _run(runner, [runner.add(spec.request(p, 24, temperature=0.8, seed=s)) for p, s in zip(prompts, seeds)])
    assert [g.output_token_ids for g in got] == [plain[p] for p in prompts]
    assert sum(g.accepted_tokens for g in got) > 0


def test_draft_model_rows_join_batches(tokenizer):
    """A draft model's rows are rows like any other: each holds a draft sequence in a row of the draft engine's
    workspace; outputs equal plain generation's."""
    target = make_tiny_model("llama", tokenizer)
    plain = KVBoost(target, tokenizer, chunk_size=16)
    engine = KVBoost(target, tokenizer, chunk_size=16, draft_model=make_tiny_model("llama", tokenizer, seed=1),
                     speculative="draft")
    prompts = [REPEATED, "hello there, river stone", REPEATED + " lantern"]
    want = [plain.generate(p, 10).output_token_ids for p in prompts]
    got = engine.generate_batch(prompts, 10)
    assert [g.output_token_ids for g in got] == want
    assert all(g.speculative == "draft" for g in got) and sum(g.draft_tokens for g in got) > 0
    assert engine.generate(REPEATED, 10).output_token_ids == want[0]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_traffic_with_ragged_verifies_equals_plain_generation(tokenizer, seed):
    """Rows of random prompts, budgets, stops and speculation on or off, joining as others leave (3 slots for 7
    requests): every output equals plain generation's, and the batch verified drafts beside company."""
    import random

    rng = random.Random(seed)
    model = make_tiny_model("llama", tokenizer)
    plain = KVBoost(model, tokenizer, chunk_size=16)
    spec = KVBoost(model, tokenizer, chunk_size=16, speculative="prompt_lookup", num_speculative_tokens=6)
    words = REPEATED.split()
    prompts = [" ".join(rng.choice(words) for _ in range(rng.randint(8, 40))) for _ in range(7)]
    options = [{"max_new_tokens": rng.randint(1, 40), "speculative": rng.choice(["prompt_lookup", "off"])}
               for _ in prompts]
    for o in options[::3]:
        o["stop"] = [rng.choice(words)]
    want = [plain.generate(p, **{k: v for k, v in o.items() if k != "speculative"}) for p, o in zip(prompts, options)]
    runner = Scheduler(spec, max_batch_size=3)
    got = _run(runner, [runner.add(spec.request(p, **o)) for p, o in zip(prompts, options)])
    assert [(g.output_token_ids, g.finish_reason) for g in got] == [(w.output_token_ids, w.finish_reason)
                                                                    for w in want]
    assert runner.speculation.drafting.verifies > 0
