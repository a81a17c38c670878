"""One sequence's speculative decode step: propose drafts, verify them in one forward, keep what the target agrees
with, and report how far the sequence's K/V advanced (the rest is rolled back by the caller's length).

The caller (a row's slot, batch/speculation.py) owns the K/V: it hands a `forward(tokens, start)` that runs tokens at
positions [start, start + n) after the K/V of [0, start) and returns float32 logits [n, vocab]. K/V past the
kept tokens is simply never counted: the caller's length advances by exactly the number of tokens returned,
so the next forward overwrites the rejected positions and write-back never sees them.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from ..sampling import Sampler
from .prompt_lookup import PromptLookup
from .speculative import (
    AdaptiveK,
    SpecCounts,
    SpeculativeParams,
    StepCosts,
    accept_greedy,
    lookup_min_ngram,
)

Forward = Callable[[list[int], int], torch.Tensor]


class Proposer(Protocol):
    def extend(self, tokens: Sequence[int]) -> None:
        """Tokens emitted after the context the proposer holds."""

    def propose(self, k: int) -> list[int]:
        """Up to k draft tokens following the context (may be fewer, or none)."""

    def close(self, emitted: Sequence[int]) -> None:
        """The request is over; `emitted` is prompt + output as finally kept."""


class LookupProposer:
    """Prompt lookup as a Proposer (no model, nothing to release). A request's predicted output comes first in
    the searched text: the earliest occurrence wins, so drafts follow the prediction where it matches.
    params.min_ngram None ("auto"): each proposal's shortest n-gram follows the engine's measured step costs
    (`costs`, shared with the request's AdaptiveK; lookup_min_ngram)."""

    def __init__(self, context: Sequence[int], params: SpeculativeParams, capacity: int,
                 costs: StepCosts | None = None):
        self.lookup = PromptLookup([*params.prediction, *context], params.max_ngram, params.min_ngram or 1,
                                   capacity=capacity)
        self.auto_min_ngram = params.min_ngram is None
        self.costs = costs

    def extend(self, tokens: Sequence[int]) -> None:
        self.lookup.extend(tokens)

    def propose(self, k: int) -> list[int]:
        return self.lookup.propose(k, lookup_min_ngram(self.costs) if self.auto_min_ngram else None)

    def close(self, emitted: Sequence[int]) -> None:
        pass


class Speculator:
    def __init__(self, proposer: Proposer, sampler: Sampler, params: SpeculativeParams, forward: Forward,
                 costs: StepCosts | None = None):
        """costs: the engine's measured step costs for this method (shared across its requests), or None."""
        self.proposer, self.sampler, self.params, self.forward = proposer, sampler, params, forward
        self.adaptive = AdaptiveK(params.num_tokens, costs=costs)
        self.counts = SpecCounts()

    def step(self, token: int, length: int, budget: int) -> list[int]:
        """Feed `token` (the last emitted one; its K/V not yet computed) at position `length`, with drafts after
        it. Returns the tokens emitted by this step: the kept drafts and the target's next token (1 to k + 1
        of them, never more than `budget`). The K/V of `token` and the kept drafts is valid afterwards, i.e.
        positions [0, length + len(returned))."""
        t0 = time.perf_counter()  # the cost of a step includes proposing (a draft model's forwards)
        drafts = self.drafts(self.adaptive.next_k(budget - 1))
        logits = self.forward([token, *drafts], length)
        out = self.pick(logits, drafts)
        # pick() copied its tokens to the host, which waits for the forward: the time is the step's real cost.
        self.adaptive.timed(1 + len(drafts), time.perf_counter() - t0)
        self.account(drafts, out)
        return out

    def drafts(self, k: int) -> list[int]:
        """Up to k drafts following the context, cut before the first one a grammar (if any) forbids: those could
        never be kept, so they are not verified."""
        drafts = self.proposer.propose(k) if k > 0 else []
        constraint = self.sampler.constraint
        if constraint is not None and drafts:
            drafts = drafts[:constraint.accepted_prefix(drafts)]
        return drafts

    def accept(self, logits: torch.Tensor, drafts: list[int], batched: bool = False) -> list[int]:
        """The tokens a verify of these drafts emits (logits [len(drafts) + 1, vocab], float32), counted and fed to
        the proposer: a step whose forward the caller ran itself (batched: a batch's ragged verify)."""
        out = self.pick(logits, drafts)
        self.account(drafts, out, batched)
        return out

    def pick(self, logits: torch.Tensor, drafts: list[int]) -> list[int]:
        """The kept drafts and the target's own next token. Greedy: every argmax at once. Otherwise the sampler picks
        each position in turn and a draft is kept while it equals the pick (sample_through): for point-mass drafts
        that keeps each draft with probability p(d) and replaces a rejected one by a draw from p without d - the
        speculative-sampling rule's distribution - while the sampler draws exactly once per emitted token, as it
        does without speculation. A seeded request's output is therefore its non-speculative output, whatever
        drafts were proposed and whichever rows it was verified beside."""
        if self.sampler.plain and self.sampler.params.greedy:
            return accept_greedy(logits, drafts)
        return sample_through(self.sampler, logits, drafts)

    def account(self, drafts: list[int], out: list[int], batched: bool = False) -> None:
        if drafts:
            self.adaptive.update(len(drafts), len(out) - 1)
            self.counts.add(len(drafts), len(out) - 1, batched)
        self.proposer.extend(out)

    def close(self, emitted: Sequence[int]) -> None:
        self.proposer.close(emitted)


def sample_through(sampler: Sampler, logits: torch.Tensor, drafts: Sequence[int]) -> list[int]:
    """Verification for a sampler that masks (a grammar) or reports log-probabilities: the sampler picks each
    position's token in turn, exactly as it would without speculation (mask, log-probabilities and grammar state
    advance for every emitted token and no other), and a draft is kept while it equals that pick. Greedy output
    is identical to non-speculative greedy; sampled tokens keep the target's distribution (each is drawn from
    it given the tokens before), at a lower acceptance than the speculative-sampling rule. logits [k + 1, vocab]."""
    out: list[int] = []
    for i, row in enumerate(logits):
        pick = sampler(row)
        out.append(pick)
        if i >= len(drafts) or pick != drafts[i]:
            break
    return out
