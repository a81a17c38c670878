"""Speculative sampling keeps the target's distribution: with point-mass drafts, the first emitted token follows p0
and, when the first draft was kept, the second follows p1 (the target's distribution after that draft). Measured
on a tiny model's real distributions through Speculator.step; a broken rule fails the same check."""
from __future__ import annotations

from collections import Counter

import torch

from kvboost.decoding.speculative import SpeculativeParams
from kvboost.decoding.speculator import Speculator
from kvboost.model.forward import forward_tokens
from kvboost.sampling import Sampler, SamplingParams

from ..tiny_models import make_tiny_model

N = 4000


class Fixed:
    def __init__(self, drafts):
        self.drafts = drafts

    def extend(self, tokens):
        pass

    def propose(self, k):
        return self.drafts[:k]

    def close(self, emitted):
        pass


def _target(tokenizer, params):
    """Real distributions of a tiny model: logits after `prompt` and after each draft."""
    model = make_tiny_model("llama", tokenizer)
    ids = tokenizer("river stone lantern quiet orbit")["input_ids"]
    with torch.inference_mode():
        logits = forward_tokens(model, ids, None, logits_to_keep=1)[0, -1].cpu()
    # Keep the test fast: the distributions restricted to the 8 tokens most likely after the prompt (a small
    # vocabulary of real logits; token i of it is the i-th most likely).
    top = torch.argsort(logits, descending=True)[:8]
    d1 = 1  # the 2nd most likely token: accepted only sometimes
    with torch.inference_mode():
        both = forward_tokens(model, ids + [int(top[d1])], None, logits_to_keep=2)[0].cpu()
    return both[:, top].contiguous(), d1


def _histograms(both, d1, d2, params, accept_all=False):
    sampler = Sampler(SamplingParams(**params.__dict__ | {"seed": 1234}))
    spec = Speculator(Fixed([d1, d2]), sampler, SpeculativeParams("prompt_lookup", num_tokens=2),
                      lambda tokens, start: torch.cat([both, both[-1:]]))
    first, second = Counter(), Counter()
    for _ in range(N):
        costs = spec.adaptive.costs
        spec.adaptive.wait, costs.t1, costs.base, costs.extra = 0, 1.0, 1.0, 0.0  # k = 2
        out = [d1, d2, int(torch.multinomial(sampler.probabilities(both[-1]), 1, generator=sampler.generator))] \
            if accept_all else spec.step(0, 0, 10)
        first[out[0]] += 1
        if out[0] == d1:
            second[out[1]] += 1
    return first, second


def _tv(counts: Counter, p: torch.Tensor) -> float:
    total = sum(counts.values())
    emp = torch.zeros_like(p)
    for t, c in counts.items():
        emp[t] = c / total
    return 0.5 * float((emp - p).abs().sum())


def test_speculative_sampling_matches_the_target_distribution(tokenizer):
    params = SamplingParams(temperature=2.0, top_k=6)
    both, d1 = _target(tokenizer, params)
    sampler = Sampler(params)
    p0, p1 = sampler.probabilities(both[0]), sampler.probabilities(both[1])
    d2 = int(torch.argmax(p1))
    first, second = _histograms(both, d1, d2, params)
    # Sampling noise of a TV distance over 6 outcomes at these counts is ~0.01-0.03; errors of the rule are larger.
    assert _tv(first, p0) < 0.04, (first, p0)
    assert sum(second.values()) > 300
    assert _tv(second, p1) < 0.06, (second, p1)
    # The same check fails for a rule that keeps every draft.
    bad_first, _ = _histograms(both, d1, d2, params, accept_all=True)
    assert _tv(bad_first, p0) > 0.3


def test_sampled_generation_runs_and_is_seeded(tokenizer):
    from kvboost import KVBoost

    engine = KVBoost(make_tiny_model("llama", tokenizer), tokenizer, chunk_size=16)
    prompt = "river stone lantern quiet orbit river stone lantern quiet orbit river stone"
    a = engine.generate(prompt, 16, temperature=0.8, seed=3, speculative="prompt_lookup")
    b = engine.generate(prompt, 16, temperature=0.8, seed=3, speculative="prompt_lookup")
    assert a.output_token_ids == b.output_token_ids and a.generated_tokens == 16
