"""One sequence's speculative decode step: propose drafts, verify them in one forward, keep what the target agrees
with. The caller owns the K/V; its length advances by exactly the tokens returned."""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from ..sampling import Sampler
from .prompt_lookup import PromptLookup
from .speculative import AdaptiveK, SpecCounts, SpeculativeParams, StepCosts, accept_greedy, lookup_min_ngram

Forward = Callable[[list[int], int], torch.Tensor]


class Proposer(Protocol):
    def extend(self, tokens: Sequence[int]) -> None:
        """Tokens emitted after the context the proposer holds."""

    def propose(self, k: int) -> list[int]:
        """Up to k draft tokens following the context (may be fewer, or none)."""

    def close(self, emitted: Sequence[int]) -> None:
        """The request is over; `emitted` is prompt + output as finally kept."""


class LookupProposer:
    """Prompt lookup as a Proposer. A request's predicted output comes first in the searched text. params.min_ngram None
    (auto) follows the engine's measured step costs (lookup_min_ngram)."""

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
        """Feed `token` at position `length` with drafts after it; returns emitted tokens (1 to k + 1, <= `budget`)."""
        t0 = time.perf_counter()  # the cost of a step includes proposing (a draft model's forwards)
        drafts = self.drafts(self.adaptive.next_k(budget - 1))
        out = self.pick(self.forward([token, *drafts], length), drafts)
        # pick() copied its tokens to the host, so the time includes the forward.
        self.adaptive.costs.record(1 + len(drafts), time.perf_counter() - t0)
        self.account(drafts, out)
        return out

    def drafts(self, k: int) -> list[int]:
        """Up to k drafts, cut before the first one a grammar forbids (it could never be kept)."""
        drafts = self.proposer.propose(k) if k > 0 else []
        constraint = self.sampler.constraint
        if constraint is not None and drafts:
            drafts = drafts[:constraint.accepted_prefix(drafts)]
        return drafts

    def accept(self, logits: torch.Tensor, drafts: list[int], batched: bool = False) -> list[int]:
        """Emitted tokens of a verify the caller ran (logits [len(drafts) + 1, vocab] float32), counted."""
        out = self.pick(logits, drafts)
        self.account(drafts, out, batched)
        return out

    def pick(self, logits: torch.Tensor, drafts: list[int]) -> list[int]:
        """The kept drafts and the target's next token: greedy all at once, else sample_through."""
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
    """Verification for a sampler that masks or reports log-probabilities: each position is picked as without
    speculation and a draft kept while it equals the pick. logits [k + 1, vocab]."""
    out: list[int] = []
    for i, row in enumerate(logits):
        pick = sampler(row)
        out.append(pick)
        if i >= len(drafts) or pick != drafts[i]:
            break
    return out
