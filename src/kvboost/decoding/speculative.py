"""Speculative decoding: which tokens of a verified draft to keep.

A proposer (prompt lookup, a draft model) guesses the next k tokens d1..dk. The target model runs the last
sampled token t0 and the drafts in ONE forward, which yields its logits after t0, d1, ..., dk: k + 1
distributions p0..pk. This module decides how many drafts to keep and which token follows them:

* greedy: keep d_{i+1} while it equals argmax(p_i); the first disagreement is replaced by the argmax (a
  "correction"), and when every draft is kept argmax(p_k) is a free "bonus" token. The output is the greedy
  output, token for token: every kept token is the argmax of the target's own distribution.
* sampling: drafts are deterministic proposals (q is a point mass on d), so the standard rule (Leviathan et
  al. 2023, Chen et al. 2023) reads: keep d_{i+1} with probability min(1, p_i(d)/q(d)) = p_i(d); on the first
  rejection sample from the residual max(0, p_i - q), i.e. p_i with d removed, renormalized; after k kept
  drafts sample the bonus from p_k. Each emitted token is then distributed exactly as p.

AdaptiveK sizes the next proposal from measured acceptance, so text the proposer cannot predict does not pay
for verifying long drafts that get rejected.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import InvalidRequestError

METHODS = ("prompt_lookup", "draft", "off")
MAX_SPECULATIVE_TOKENS = 15  # k + 1 verified tokens fit the runner's smallest suffix bucket (16)
MAX_NGRAM = 16


@dataclass(frozen=True)
class SpeculativeParams:
    """A request's speculation, resolved: method is "prompt_lookup" or "draft" (off is None, not a value)."""

    method: str
    num_tokens: int = 8  # k: the most drafts verified in one forward
    max_ngram: int = 3
    min_ngram: int = 1

    def __post_init__(self) -> None:
        if self.method not in ("prompt_lookup", "draft"):
            raise InvalidRequestError(f"unknown speculative method {self.method!r}; expected prompt_lookup or "
                                      "draft (or off/None for no speculation)", "speculative")
        check_speculative_numbers(self.num_tokens, self.max_ngram, self.min_ngram)


def parse_method(value: object) -> str | None:
    """"prompt_lookup" / "draft", or None for "off"/None/False; InvalidRequestError for anything else."""
    if value is None or value is False:
        return None
    if isinstance(value, str) and value.lower() in METHODS:
        v = value.lower()
        return None if v == "off" else v
    raise InvalidRequestError(f"unknown speculative {value!r}; expected one of: prompt_lookup, draft, off "
                              "(or None)", "speculative")


def check_speculative_numbers(k: object, max_ngram: object, min_ngram: object) -> None:
    def is_int(x: object) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    if not is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:  # type: ignore[operator]
        raise InvalidRequestError(f"num_speculative_tokens must be an int in [1, {MAX_SPECULATIVE_TOKENS}], "
                                  f"got {k!r}", "num_speculative_tokens")
    if not is_int(max_ngram) or not 1 <= max_ngram <= MAX_NGRAM:  # type: ignore[operator]
        raise InvalidRequestError(f"prompt_lookup_max_ngram must be an int in [1, {MAX_NGRAM}], got {max_ngram!r}",
                                  "prompt_lookup_max_ngram")
    if not is_int(min_ngram) or not 1 <= min_ngram <= max_ngram:  # type: ignore[operator]
        raise InvalidRequestError(f"prompt_lookup_min_ngram must be an int in [1, prompt_lookup_max_ngram="
                                  f"{max_ngram}], got {min_ngram!r}", "prompt_lookup_min_ngram")


# ---- acceptance ---------------------------------------------------------------------------------------
def accept_greedy(logits: torch.Tensor, drafts: Sequence[int]) -> list[int]:
    """logits [k + 1, vocab] of the target after t0, d1..dk. Returns the kept drafts followed by the target's
    own next token (the correction, or the bonus when all drafts are kept): 1 to k + 1 tokens."""
    picks = logits.argmax(dim=-1).tolist()  # one device-to-host copy for the whole burst
    out: list[int] = []
    for d, p in zip(drafts, picks):
        if d != p:
            break
        out.append(d)
    out.append(picks[len(out)])
    return out


def accept_sampled(probs: torch.Tensor, drafts: Sequence[int], generator: torch.Generator | None) -> list[int]:
    """probs [k + 1, vocab] (the target's sampling distributions after t0, d1..dk, on the CPU) and point-mass
    drafts: the speculative-sampling rule. Returns the kept drafts and one sampled token after them."""
    out: list[int] = []
    uniforms = torch.rand(len(drafts), generator=generator).tolist()
    for i, d in enumerate(drafts):
        p_d = float(probs[i, d])
        if uniforms[i] < p_d:  # accept with probability min(1, p(d) / q(d)), q(d) = 1
            out.append(d)
            continue
        residual = probs[i].clone()
        residual[d] = 0.0  # max(0, p - q) for a point mass q on d
        total = float(residual.sum())
        if total <= 0.0:  # p was a point mass on d itself: rejection had probability 0; keep d
            out.append(d)
            continue
        out.append(int(torch.multinomial(residual / total, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(probs[len(drafts)], 1, generator=generator)))
    return out


# ---- how many drafts to propose ---------------------------------------------------------------------
class AdaptiveK:
    """The number of drafts to propose next, from measured acceptance.

    Verifying k drafts costs more than a decode step of one token, and the extra is wasted on every rejected
    draft. Policy (per request): after a fully accepted proposal k grows by 2 (up to k_max); after a partial
    one it becomes accepted + 1. When proposals keep failing (an exponential moving average of kept drafts per
    proposal under `min_gain`), proposing pauses for `pause` steps, doubling up to `max_pause` while it keeps
    failing, then retries with one draft: open-ended text pays for about one short verify per pause.
    """

    def __init__(self, k_max: int, min_gain: float = 0.5, max_pause: int = 64):
        self.k_max, self.k = k_max, k_max
        self.min_gain, self.max_pause = min_gain, max_pause
        self.gain = 1.0  # EMA of drafts kept per proposal
        self.pause, self.wait = 4, 0

    def next_k(self, budget: int) -> int:
        """Drafts to propose now (0: decode one token normally). budget: tokens that may still be emitted
        after this step's correction token."""
        if self.wait > 0:
            self.wait -= 1
            return 0
        return max(0, min(self.k, budget))

    def update(self, proposed: int, kept: int) -> None:
        if proposed <= 0:
            return
        self.gain = 0.6 * self.gain + 0.4 * kept
        if kept == proposed:
            self.k = min(self.k_max, self.k + 2)
        else:
            self.k = max(1, kept + 1)
        if self.gain < self.min_gain:
            self.wait, self.pause = self.pause, min(self.max_pause, self.pause * 2)
            self.k, self.gain = 1, self.min_gain  # retry small; one success lifts it again
        elif kept > 0:
            self.pause = 4


@dataclass
class SpecCounts:
    """Draft accounting for one request (or summed over many)."""

    proposals: int = 0  # verify forwards that carried drafts
    draft_tokens: int = 0  # drafts proposed and verified
    accepted_tokens: int = 0  # drafts kept

    def add(self, proposed: int, kept: int) -> None:
        self.proposals += 1
        self.draft_tokens += proposed
        self.accepted_tokens += kept

    def merge(self, other: SpecCounts) -> None:
        self.proposals += other.proposals
        self.draft_tokens += other.draft_tokens
        self.accepted_tokens += other.accepted_tokens

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    def as_dict(self) -> dict:
        return {"proposals": self.proposals, "draft_tokens": self.draft_tokens,
                "accepted_tokens": self.accepted_tokens, "acceptance_rate": self.acceptance_rate}
