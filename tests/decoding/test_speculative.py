"""Speculative decoding, greedy: output identical to plain greedy, token for token, with drafts accepted,
rejected and partly accepted; stops, EOS and max_new_tokens inside bursts; rollback never stored; errors."""
from __future__ import annotations

import random

import pytest

from kvboost import KVBoost
from kvboost.decoding import factory
from kvboost.decoding.prompt_lookup import PromptLookup
from kvboost.decoding.speculative import AdaptiveK, StepCosts, accept_greedy
from kvboost.errors import InvalidRequestError

from ..prompts import text_with_tokens, words
from ..tiny_models import make_tiny_model


class Scripted:
    """A proposer that knows the plain greedy output and proposes it, corrupted at a random draft position with
    probability `wrong` (so verification must reject and roll back there)."""

    def __init__(self, n_prompt: int, truth: list[int], wrong: float, seed: int = 0):
        self.n_prompt, self.truth, self.wrong = n_prompt, truth, wrong
        self.rng = random.Random(seed)
        self.emitted = 0
        self.proposed = 0

    def extend(self, tokens):
        self.emitted += len(tokens)

    def propose(self, k):
        drafts = list(self.truth[self.emitted:self.emitted + k])
        if drafts and self.rng.random() < self.wrong:
            i = self.rng.randrange(len(drafts))
            drafts[i] = (drafts[i] + 17) % 1000 + 3
        self.proposed += len(drafts)
        return drafts

    def close(self, emitted):
        pass


def _script(monkeypatch, truth: list[int], wrong: float) -> list[Scripted]:
    made: list[Scripted] = []

    def make(engine, request, context, costs=None):
        made.append(Scripted(len(request.ids), truth, wrong))
        made[-1].emitted = len(context) - len(request.ids)
        return made[-1]

    monkeypatch.setattr(factory, "make_proposer", make)
    return made


def test_prompt_lookup_finds_the_longest_earliest_ngram():
    pl = PromptLookup([5, 6, 7, 8, 9, 1, 6, 7, 2, 5, 6, 7], max_ngram=3, min_ngram=1)
    assert pl.propose(3) == [8, 9, 1]  # "5 6 7" first occurs at 0: what followed it there
    pl.extend([4])
    assert pl.propose(2) == []  # 4 never occurred before
    pl2 = PromptLookup([1, 2, 3, 9, 2, 3], max_ngram=2, min_ngram=2)
    assert pl2.propose(5) == [9, 2, 3]  # never the suffix itself
    assert PromptLookup([1, 2, 3], 3, 2).propose(4) == []


def test_accept_greedy_keeps_the_agreeing_prefix_and_adds_the_targets_token():
    import torch

    logits = torch.full((4, 10), -1.0)
    for i, t in enumerate([3, 4, 5, 6]):
        logits[i, t] = 1.0
    assert accept_greedy(logits, [3, 4, 5]) == [3, 4, 5, 6]  # all kept + bonus
    assert accept_greedy(logits, [3, 9, 5]) == [3, 4]  # correction at the first disagreement
    assert accept_greedy(logits[:1], []) == [3]


def test_adaptive_k_follows_acceptance_and_step_cost():
    a = AdaptiveK(8)
    assert a.next_k(100) == 0  # the first step is plain: it times t1
    a.costs.record(1, 1.0)
    assert a.next_k(100) == 2 and a.next_k(100) == 2  # a short probe until an extra token's cost is measured
    a.costs.record(9, 5.0)  # a verify costs 5 steps (one length timed: taken as the cost of every length)
    for _ in range(6):
        a.update(8, 8)
    assert a.next_k(100) == 8 and a.next_k(3) == 3  # high acceptance: long drafts, never past the budget
    for _ in range(6):
        a.update(8, 0)
    assert a.next_k(100) == 1  # low acceptance: a plain step pays more; one probe, then a pause
    skipped = 0
    while a.next_k(100) == 0:
        skipped += 1
    assert skipped >= 4
    burst = AdaptiveK(8)
    burst.costs.record(1, 1.0)
    burst.costs.record(9, 5.0)
    for _ in range(6):
        burst.update(8, 0)
    burst.update(3, 3)  # a span copied whole: long drafts next, whatever the average says
    assert burst.next_k(100) == 8
    burst.update(8, 2)
    assert burst.next_k(100) < 8
    free = AdaptiveK(8)  # GPU-like: extra verified tokens cost ~nothing, so even modest acceptance pays
    free.costs.record(1, 1.0)
    free.costs.record(9, 1.05)
    for _ in range(6):
        free.update(4, 1)
    assert free.next_k(100) >= 4


def test_step_costs_carry_over_to_the_next_request():
    costs = StepCosts()
    first = AdaptiveK(8, costs=costs)
    assert first.next_k(100) == 0  # an engine's first request times a plain step and probes
    first.costs.record(1, 1.0)
    assert first.next_k(100) == 2
    first.costs.record(3, 1.8)
    first.costs.record(9, 2.0)
    second = AdaptiveK(8, costs=costs)  # the next request of the same engine and method
    assert second.costs.t1 == 1.0 and second.costs.base is not None and second.costs.extra is not None
    # No plain first step, no probe: the prior acceptance decides at once. 4-9 tokens are taken at the cost of 3
    # (never timed, or 9: timed once only), so the longest wins.
    assert second.next_k(100) == 8
    second.costs.record(1, 3.0)  # and what it measures updates the shared costs for the one after
    assert costs.t1 == 0.8 * 1.0 + 0.2 * 3.0
    assert AdaptiveK(8).next_k(100) == 0  # costs of its own: starts cold


def test_the_shortest_ngram_follows_the_measured_verify_cost_unless_set():
    """prompt_lookup_min_ngram None (the default) is "auto": a lone recurring token drafts only where a 2-token verify
    measured about a plain step; before anything is measured, and where it costs nearly two, a 2-gram must match.
    A value set on the engine or the request is used as it is."""
    from kvboost.config import EngineConfig
    from kvboost.decoding.factory import resolve_speculation
    from kvboost.decoding.speculative import StepCosts, lookup_min_ngram
    from kvboost.decoding.speculator import LookupProposer

    assert EngineConfig().prompt_lookup_min_ngram is None
    assert EngineConfig(prompt_lookup_min_ngram=1).prompt_lookup_min_ngram == 1
    with pytest.raises(ValueError):
        EngineConfig(prompt_lookup_max_ngram=2, prompt_lookup_min_ngram=3)
    cheap, dear = StepCosts(t1=0.035), StepCosts(t1=0.107)
    cheap.by_length[2], dear.by_length[2] = 0.036, 0.195  # cpu_linear at one thread; a CPU without it
    assert lookup_min_ngram(None) == lookup_min_ngram(StepCosts()) == 2
    assert lookup_min_ngram(StepCosts(t1=0.035)) == 2  # no verify timed yet
    assert lookup_min_ngram(cheap) == 1 and lookup_min_ngram(dear) == 2

    context = [5, 6, 7, 8, 9, 1, 6, 2, 7]  # "7" recurs alone; no 2-gram of the end recurs
    auto = resolve_speculation(EngineConfig(speculative="prompt_lookup"), False)
    assert auto.min_ngram is None
    assert LookupProposer(context, auto, 8, costs=cheap).propose(3) == [8, 9, 1]
    assert LookupProposer(context, auto, 8, costs=dear).propose(3) == []
    fixed = resolve_speculation(EngineConfig(speculative="prompt_lookup", prompt_lookup_min_ngram=2), False)
    assert LookupProposer(context, fixed, 8, costs=cheap).propose(3) == []  # set: used whatever the costs
    request = resolve_speculation(EngineConfig(speculative="prompt_lookup"), False, prompt_lookup_min_ngram=1)
    assert LookupProposer(context, request, 8, costs=dear).propose(3) == [8, 9, 1]
    capped = resolve_speculation(EngineConfig(speculative="prompt_lookup", prompt_lookup_min_ngram=2), False,
                                 prompt_lookup_max_ngram=1)
    assert capped.min_ngram == 1  # lowered to the requested maximum


def test_cache_stats_report_the_shortest_ngram_set_or_picked(tokenizer):
    from kvboost.decoding.speculative import lookup_min_ngram

    model = make_tiny_model("llama", tokenizer)
    auto = KVBoost(model, tokenizer, chunk_size=16, speculative="prompt_lookup")
    stats = auto.cache_stats()["speculative"]
    assert (stats["prompt_lookup_min_ngram"], stats["prompt_lookup_min_ngram_now"]) == ("auto", 2)  # nothing timed
    auto.generate("river stone lantern quiet orbit " * 6, 24)
    assert auto.cache_stats()["speculative"]["prompt_lookup_min_ngram_now"] == \
        lookup_min_ngram(auto.spec_costs["prompt_lookup"])
    fixed = KVBoost(model, tokenizer, chunk_size=16, prompt_lookup_min_ngram=3)
    assert fixed.cache_stats()["speculative"]["prompt_lookup_min_ngram"] == 3
    assert fixed.cache_stats()["speculative"]["prompt_lookup_min_ngram_now"] == 3


def test_verify_cost_is_timed_per_length_with_the_fit_below_and_optimism_above():
    """A length timed costs what it measured (a decaying mean), whatever the line through the others says - on a
    CPU the cost jumps where MKL changes kernels (cpu_linear: 4 rows 39 ms, 5 rows 64 ms at one thread); a length
    never timed costs what the longest timed one below it did (so it is tried once), or the fit's line below
    every timed length."""
    cpu = AdaptiveK(8)
    cpu.costs.record(1, 1.0)
    cpu.costs.record(3, 2.0)
    assert cpu.costs.extra is None  # no slope yet
    assert cpu.costs.estimate_s(9) == 2.0 and cpu.costs.estimate_s(2) == 2.0
    cpu.costs.record(9, 2.2)
    assert 0.0 < cpu.costs.extra < 0.05 and cpu.costs.estimate_s(3) == 2.0
    assert cpu.costs.estimate_s(9) == 2.0  # timed once only: not trusted above the optimistic figure
    cpu.costs.record(9, 2.4)
    assert cpu.costs.estimate_s(9) == pytest.approx(2.2)  # twice: its own time (the better of the two)
    assert cpu.costs.estimate_s(5) == 2.0 and cpu.costs.estimate_s(2) == pytest.approx(cpu.costs.base)
    cpu.costs.record(3, 3.0)
    assert cpu.costs.estimate_s(3) == pytest.approx(2.0)
    for _ in range(6):
        cpu.update(8, 4)  # a ~ 0.8: half of each proposal kept
    assert cpu.next_k(100) >= 3  # long drafts pay where lengths cost about the same
    # Costs that jump past 4 tokens: 3 drafts (4 tokens) are chosen once every length was timed.
    jump = AdaptiveK(8)
    jump.costs.record(1, 1.0)
    for n in list(range(2, 10)) * 2:
        jump.costs.record(n, 1.05 if n <= 4 else 2.0)
    for _ in range(6):
        jump.update(8, 4)  # a ~ 0.8
    assert jump.next_k(100) == 3
    jump.update(3, 3)  # kept whole: judged at acceptance 0.9 at least, still not worth twice the cost
    assert jump.streak and jump.next_k(100) == 3
    # One slow outlier the first time a length runs does not rule it out: it is retried, then trusted.
    spike = AdaptiveK(8)
    for n, t in ((1, 1.0), (3, 1.0), (4, 5.0)):
        spike.costs.record(n, t)
    assert spike.costs.estimate_s(4) == 1.0
    spike.costs.record(4, 1.1)
    assert spike.costs.estimate_s(4) == pytest.approx(1.1)  # the better of its first two timings
    spike.costs.record(4, 2.1)
    assert spike.costs.estimate_s(4) == pytest.approx(0.8 * 1.1 + 0.2 * 2.1)  # then a decaying mean
    # A cost growing a plain step per token: nothing beats a plain step once every length was tried.
    linear = AdaptiveK(8)
    linear.costs.record(1, 1.0)
    for n in list(range(2, 10)) * 2:
        linear.costs.record(n, float(n))
    assert abs(linear.costs.extra - 1.0) < 1e-6 and abs(linear.costs.base - 2.0) < 1e-6
    for _ in range(6):
        linear.update(8, 4)
    assert linear.next_k(100) == 1  # one probe, then a pause
    assert linear.wait > 0


@pytest.mark.parametrize("arch,wrong", [("llama", 0.0), ("llama", 1.0), ("qwen2", 0.5), ("gemma2", 0.5)])
def test_greedy_output_is_identical_with_accepted_and_rejected_drafts(arch, wrong, tokenizer, monkeypatch):
    engine = KVBoost(make_tiny_model(arch, tokenizer), tokenizer, chunk_size=16)
    prompt = text_with_tokens(tokenizer, 50, seed=1)
    plain = engine.generate(prompt, 24)
    made = _script(monkeypatch, plain.output_token_ids, wrong)
    spec = engine.generate(prompt, 24, speculative="prompt_lookup", num_speculative_tokens=6)
    assert spec.output_token_ids == plain.output_token_ids
    assert spec.output_text == plain.output_text and spec.finish_reason == plain.finish_reason
    assert spec.draft_tokens == made[0].proposed > 0
    if wrong < 1.0:
        assert spec.accepted_tokens > 0
    if wrong > 0.0:
        assert spec.accepted_tokens < spec.draft_tokens
    # The workspace holds exactly prompt + output (minus the last token, never run): no rejected draft.
    ids = engine.encode(prompt)
    assert engine.workspace.resident_ids == ids + plain.output_token_ids[:-1]


def test_real_prompt_lookup_accepts_drafts_on_repetitive_output(tokenizer):
    """No scripting: a tiny random model falls into loops that prompt lookup predicts. Prompts 4 and 5 send this
    model into a repeated token within 48 tokens (prompts 0-2 barely repeat: a handful of kept drafts, or none,
    depending on how many the timed step costs let AdaptiveK propose)."""
    engine = KVBoost(make_tiny_model("llama", tokenizer), tokenizer, chunk_size=16)
    accepted = 0
    for seed in (4, 5):
        prompt = text_with_tokens(tokenizer, 40, seed=seed)
        plain = engine.generate(prompt, 48)
        spec = engine.generate(prompt, 48, speculative="prompt_lookup")
        assert spec.output_token_ids == plain.output_token_ids
        accepted += spec.accepted_tokens
    assert accepted > 0
    stats = engine.cache_stats()["speculative"]
    assert stats["accepted_tokens"] == accepted and 0 < stats["acceptance_rate"] <= 1
    costs = engine.spec_costs["prompt_lookup"]  # measured by these requests, kept for the engine's next ones
    assert costs.t1 is not None and costs.base is not None and set(engine.spec_costs) == {"prompt_lookup"}
    reported = stats["step_costs"]["prompt_lookup"]  # the same measurement, in ms
    assert reported["plain_step_ms"] == pytest.approx(1e3 * costs.t1)
    assert reported["verify_ms"]["2"] == pytest.approx(1e3 * costs.verify_s(2))
    assert reported["lengths_timed"] == sorted(costs.by_length) and reported["lengths_timed"]
    for n in costs.by_length:  # a length timed is reported as timed, not as the fit's line
        assert reported["verify_ms"][str(n)] == pytest.approx(1e3 * costs.by_length[n])


def test_step_costs_report_verifies_per_token_against_a_plain_step():
    empty = StepCosts().as_dict()
    assert empty["plain_step_ms"] is None and set(empty["verify_ms"]) == {str(n) for n in range(2, 17)}
    assert all(v is None for v in empty["verify_ms"].values())
    costs = StepCosts(t1=0.1, base=0.15, extra=0.01).as_dict()
    assert costs["plain_step_ms"] == pytest.approx(100.0)
    assert costs["verify_ms"]["2"] == pytest.approx(150.0) and costs["verify_ms"]["9"] == pytest.approx(220.0)
    assert costs["verify_per_token_over_step"]["9"] == pytest.approx(220.0 / 9 / 100.0)
    assert costs["slope_measured"] is True
    flat = StepCosts(t1=0.1, base=0.15).as_dict()  # one verify length timed: no slope yet
    assert flat["verify_ms"]["16"] == pytest.approx(150.0) and flat["slope_measured"] is False


def test_max_new_tokens_stop_strings_and_eos_inside_a_burst(tokenizer, monkeypatch):
    engine = KVBoost(make_tiny_model("llama", tokenizer), tokenizer, chunk_size=16)
    prompt = text_with_tokens(tokenizer, 40, seed=3)
    plain = engine.generate(prompt, 30)
    _script(monkeypatch, plain.output_token_ids, 0.0)
    for n in (1, 2, 5, 7):  # every draft would be accepted: the budget alone must end the output
        r = engine.generate(prompt, n, speculative="prompt_lookup", num_speculative_tokens=8)
        assert r.output_token_ids == plain.output_token_ids[:n] and r.finish_reason == "length"
    stop = plain.output_text[len(plain.output_text) // 2:][:4]
    cut = engine.generate(prompt, 30, stop=stop)
    spec_cut = engine.generate(prompt, 30, stop=stop, speculative="prompt_lookup")
    assert (spec_cut.output_text, spec_cut.finish_reason, spec_cut.output_token_ids) == \
        (cut.output_text, "stop", cut.output_token_ids)
    # EOS: make the 6th greedy token the model's EOS; a burst that contains it ends there.
    eos_engine = KVBoost(make_tiny_model("llama", tokenizer), tokenizer, chunk_size=16)
    eos_engine.eos_token_ids = {plain.output_token_ids[5]}
    first = plain.output_token_ids.index(plain.output_token_ids[5])
    r = eos_engine.generate(prompt, 30, speculative="prompt_lookup")
    assert r.output_token_ids == plain.output_token_ids[:first] and r.finish_reason == "stop"


def test_stream_arrives_in_bursts_and_joins_to_the_text(tokenizer, monkeypatch):
    engine = KVBoost(make_tiny_model("llama", tokenizer), tokenizer, chunk_size=16)
    prompt = text_with_tokens(tokenizer, 40, seed=4)
    plain = engine.generate(prompt, 32)
    _script(monkeypatch, plain.output_token_ids, 0.0)
    stream = engine.generate_stream(prompt, 32, speculative="prompt_lookup", num_speculative_tokens=8)
    deltas = list(stream)
    assert "".join(deltas) == plain.output_text
    assert len(deltas) < plain.generated_tokens // 2  # bursts, not one delta per token


def test_rejected_drafts_are_never_reused(tokenizer, monkeypatch):
    """After a speculative request whose drafts were all wrong, a follow-up that reuses its K/V (workspace and
    store) gives the same output as an engine that never speculated."""
    model = make_tiny_model("qwen2", tokenizer)
    spec_engine = KVBoost(model, tokenizer, chunk_size=16)
    plain_engine = KVBoost(model, tokenizer, chunk_size=16)
    prompt = text_with_tokens(tokenizer, 60, seed=6)
    truth = plain_engine.generate(prompt, 40).output_token_ids
    _script(monkeypatch, truth, 1.0)
    r = spec_engine.generate(prompt, 40, speculative="prompt_lookup")
    assert r.output_token_ids == truth and r.accepted_tokens < r.draft_tokens
    follow = prompt + r.output_text + " " + words(12, seed=9)
    plain_engine.clear_cache()
    a = spec_engine.generate(follow, 20)
    b = plain_engine.generate(follow, 20, mode="baseline")
    assert a.cached_tokens > 0 and a.output_token_ids == b.output_token_ids
    spec_engine.forget_workspace()  # now from the store
    c = spec_engine.generate(follow, 20)
    assert c.cached_tokens > 0 and c.output_token_ids == b.output_token_ids


def test_static_runner_verify_path_is_identical(tokenizer, monkeypatch):
    engine = KVBoost(make_tiny_model("llama", tokenizer), tokenizer, chunk_size=16, fast_path="eager")
    prompt = text_with_tokens(tokenizer, 40, seed=7)
    plain = engine.generate(prompt, 30)
    _script(monkeypatch, plain.output_token_ids, 0.5)
    r = engine.generate(prompt, 30, speculative="prompt_lookup")
    assert r.output_token_ids == plain.output_token_ids and r.accepted_tokens > 0
    assert any(key[0] == "verify" for key in engine.runner.steps)


def test_bad_values_are_typed_errors(tokenizer):
    engine = KVBoost(make_tiny_model("llama", tokenizer), tokenizer, chunk_size=16)
    cases = [dict(speculative="ngram"), dict(speculative="prompt_lookup", num_speculative_tokens=0),
             dict(speculative="prompt_lookup", num_speculative_tokens=99),
             dict(speculative="prompt_lookup", prompt_lookup_max_ngram=2, prompt_lookup_min_ngram=3),
             dict(speculative="prompt_lookup", num_speculative_tokens=True), dict(speculative="draft")]
    for options in cases:
        with pytest.raises(InvalidRequestError) as info:
            engine.generate("hello there", 4, **options)
        assert info.value.param in ("speculative", "num_speculative_tokens", "prompt_lookup_min_ngram")
    with pytest.raises(ValueError, match="speculative"):
        KVBoost(make_tiny_model("llama", tokenizer), tokenizer, speculative="maybe")
    with pytest.raises(ValueError, match="draft_model"):
        KVBoost(make_tiny_model("llama", tokenizer), tokenizer, speculative="draft")
    on = KVBoost(make_tiny_model("llama", tokenizer), tokenizer, speculative="prompt_lookup")
    assert on.generate("hello there", 4).speculative == "prompt_lookup"
    assert on.generate("hello there", 4, speculative="off").speculative is None
    assert on.generate("hello there", 4, speculative=None).speculative is None


def test_batches_take_prompt_lookup_rows_and_seeded_sampled_ones(tokenizer):
    engine = KVBoost(make_tiny_model("llama", tokenizer), tokenizer, chunk_size=16)
    prompts = [text_with_tokens(tokenizer, 30, seed=s) for s in (11, 12)]
    plain = engine.generate_batch(prompts, 20)
    spec = engine.generate_batch(prompts, 20, speculative="prompt_lookup")
    assert [r.output_token_ids for r in spec] == [r.output_token_ids for r in plain]
    assert all(r.speculative == "prompt_lookup" for r in spec) and all(r.speculative is None for r in plain)
    seeded = engine.generate_batch(prompts, 12, speculative="prompt_lookup", temperature=0.7, seed=1)
    assert [r.output_token_ids for r in seeded] == [engine.generate(p, 12, temperature=0.7, seed=1).output_token_ids
                                                    for p in prompts]
