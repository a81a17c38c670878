"""Speculative decoding: which tokens of a verified draft to keep, and how many to propose. Greedy keeps d_{i+1}
while it equals argmax(p_i); sampling draws t ~ p_i and keeps d_{i+1} while t equals it (point-mass proposals)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields

import torch

from ..errors import InvalidRequestError

METHODS = ("prompt_lookup", "draft", "off")
MAX_SPECULATIVE_TOKENS = 15  # k + 1 verified tokens fit the runner's smallest suffix bucket (16)
MAX_NGRAM = 16
# Drafts in the first verify, before its cost is known: failed long probes would cost a short answer much.
PROBE_K = 2
STREAK_ACCEPTANCE = 0.9  # the acceptance lengths are judged at right after a proposal was kept whole
# prompt_lookup_min_ngram auto: draft from a 1-gram match only where a short verify costs about a plain step.
UNIGRAM_VERIFY_OVER_STEP = 1.25


@dataclass(frozen=True)
class SpeculativeParams:
    """A request's speculation, resolved: method is "prompt_lookup" or "draft" (off is None, not a value)."""

    method: str
    num_tokens: int = 8  # k: the most drafts verified in one forward
    max_ngram: int = 3
    min_ngram: int | None = None  # None: auto (lookup_min_ngram, from the measured step costs)
    prediction: tuple[int, ...] = ()  # predicted output (OpenAI's Predicted Outputs): drafts come from it first

    def __post_init__(self) -> None:
        if self.method not in ("prompt_lookup", "draft"):
            raise InvalidRequestError(f"unknown speculative method {self.method!r}; expected prompt_lookup or "
                                      "draft (or off/None for no speculation)", "speculative")
        check_speculative_numbers(self.num_tokens, self.max_ngram, self.min_ngram)


def lookup_min_ngram(costs: StepCosts | None) -> int:
    """prompt_lookup_min_ngram "auto": 1 once a 2-token verify costs <= UNIGRAM_VERIFY_OVER_STEP steps, else 2."""
    if costs is None or costs.t1 is None:
        return 2
    verify = costs.verify_s(2)
    return 1 if verify is not None and verify <= UNIGRAM_VERIFY_OVER_STEP * costs.t1 else 2


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
    """min_ngram None is "auto" (lookup_min_ngram), valid with any max_ngram."""
    checks = [("num_speculative_tokens", k, MAX_SPECULATIVE_TOKENS, MAX_SPECULATIVE_TOKENS),
              ("prompt_lookup_max_ngram", max_ngram, MAX_NGRAM, MAX_NGRAM)]
    if min_ngram is not None:  # checked once max_ngram is known to be an int
        checks.append(("prompt_lookup_min_ngram", min_ngram, max_ngram, f"prompt_lookup_max_ngram={max_ngram}"))
    for name, value, high, shown in checks:
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= high:  # type: ignore[operator]
            raise InvalidRequestError(f"{name} must be an int in [1, {shown}], got {value!r}", name)


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


# ---- how many drafts to propose ---------------------------------------------------------------------
@dataclass
class StepCosts:
    """What a step costs on this engine for one method: a plain step (t1) and a verify of n >= 2 tokens
    (base + extra (n - 2), decaying least squares). Kept per engine; later requests skip the plain step, probe."""

    t1: float | None = None  # seconds of a plain step
    base: float | None = None  # seconds of a 2-token verify
    extra: float | None = None  # seconds per verified token beyond 2 (the slope)
    fit: list[float] = field(default_factory=lambda: [0.0] * 5)  # decaying sums over verifies: w, n, t, n^2, n t
    # Seconds per verify of each timed length (a decaying mean): on a CPU the cost is not a line in n.
    by_length: dict[int, float] = field(default_factory=dict)
    samples: dict[int, int] = field(default_factory=dict)  # verifies timed per length

    def verify_s(self, n_tokens: int) -> float | None:
        """A verify of n_tokens >= 2 in seconds: as timed at that length, else per the fit (None: nothing timed)."""
        if n_tokens in self.by_length:
            return self.by_length[n_tokens]
        return None if self.base is None else self.base + (self.extra or 0.0) * (n_tokens - 2)

    def estimate_s(self, n_tokens: int) -> float:
        """Seconds per verify of n_tokens: as timed; else the longest timed length below (optimistic), else the fit."""
        timed = self.by_length
        below = [n for n in timed if n < n_tokens]
        optimistic = timed[max(below)] if below else self.verify_s(n_tokens)
        if n_tokens in timed:
            if self.samples.get(n_tokens, 0) >= 2 or optimistic is None:
                return timed[n_tokens]
            return min(timed[n_tokens], optimistic)
        assert optimistic is not None
        return optimistic

    def record(self, n_tokens: int, seconds: float) -> None:
        """A step of n_tokens took `seconds` (measured around a host sync): 1 is a plain step, more a verify."""
        if n_tokens == 1:
            self.t1 = seconds if self.t1 is None else 0.8 * self.t1 + 0.2 * seconds
            return
        old, count = self.by_length.get(n_tokens), self.samples.get(n_tokens, 0)
        # The better of the first two timings (a first run may pay one-off costs), then a decaying mean.
        self.by_length[n_tokens] = seconds if old is None else min(old, seconds) if count == 1 else \
            0.8 * old + 0.2 * seconds
        self.samples[n_tokens] = count + 1
        w, sn, st, snn, snt = (0.8 * x for x in self.fit)
        self.fit = [w + 1, sn + n_tokens, st + seconds, snn + n_tokens * n_tokens, snt + n_tokens * seconds]
        w, sn, st, snn, snt = self.fit
        spread = w * snn - sn * sn  # w^2 x the variance of the lengths timed
        if spread > 0.25 * w * w:  # lengths that differ: the slope is measured (never negative)
            self.extra = max(0.0, (w * snt - sn * st) / spread)
        slope = self.extra or 0.0
        self.base = max(0.0, st / w - slope * (sn / w - 2))

    def as_dict(self, lengths: tuple[int, ...] = tuple(range(2, MAX_SPECULATIVE_TOKENS + 2))) -> dict:
        """Measured costs in ms: a plain step, and verifies with their cost per verified token over a plain step's."""
        t1 = None if self.t1 is None else 1e3 * self.t1
        verify = {n: None if (s := self.verify_s(n)) is None else 1e3 * s for n in lengths}
        return {"plain_step_ms": t1, "verify_ms": {str(n): v for n, v in verify.items()},
                "verify_per_token_over_step": {str(n): None if v is None or not t1 else v / n / t1
                                               for n, v in verify.items()},
                "slope_measured": self.extra is not None, "lengths_timed": sorted(self.by_length)}


class AdaptiveK:
    """The number of drafts to propose next: the k maximizing expected tokens per second, E(k) = (1 - a^(k+1)) /
    (1 - a) over the measured cost of a verify of k + 1 tokens. k = 0 pauses proposing, doubling up to `max_pause`."""

    def __init__(self, k_max: int, max_pause: int = 32, decay: float = 0.7, costs: StepCosts | None = None):
        self.k_max, self.max_pause, self.decay = k_max, max_pause, decay
        self.kept, self.rejected = 2.0, 0.5  # prior: drafts are worth trying (a ~ 0.8)
        self.costs = costs if costs is not None else StepCosts()
        self.pause, self.wait = 4, 0
        self.streak = False  # every draft of the last proposal was kept

    @property
    def acceptance(self) -> float:
        return self.kept / (self.kept + self.rejected)

    @property
    def judged_acceptance(self) -> float:
        """The acceptance lengths are judged at: at least STREAK_ACCEPTANCE after a proposal kept whole."""
        return max(self.acceptance, STREAK_ACCEPTANCE) if self.streak else self.acceptance

    def expected(self, k: int, acceptance: float | None = None) -> float:
        a = min(self.acceptance if acceptance is None else acceptance, 0.999)
        return (1 - a ** (k + 1)) / (1 - a)

    def best_k(self) -> int:
        if self.costs.base is None:  # what a verify costs is not measured yet: probe with a few
            return self.k_max if self.streak else min(self.k_max, PROBE_K) if self.acceptance > 0.5 else 1
        # After a proposal kept whole a copied span tends to go on: judge lengths at a high acceptance.
        a = self.judged_acceptance
        t1 = self.costs.t1
        rates = {0: 1.0 / t1} if t1 else {0: 0.0}
        rates.update({k: self.expected(k, a) / max(self.costs.estimate_s(k + 1), 1e-12)
                      for k in range(1, self.k_max + 1)})
        return max(rates, key=lambda k: (rates[k], -k))

    def next_k(self, budget: int) -> int:
        """Drafts to propose now (0: a plain step). budget: tokens that may still follow this step's own token."""
        if self.costs.t1 is None:  # the first step is plain: its time is the yardstick every k is judged against
            return 0
        if self.wait > 0:
            self.wait -= 1
            return 0
        k = self.best_k()
        if k == 0:  # speculation does not pay now: pause, then retry once with one draft to re-measure
            self.wait, self.pause = self.pause, min(self.max_pause, self.pause * 2)
            k = 1
        return max(0, min(k, budget))

    def update(self, proposed: int, kept: int) -> None:
        if proposed <= 0:
            return
        self.kept = self.decay * self.kept + kept
        self.rejected = self.decay * self.rejected + (0 if kept == proposed else 1)
        self.streak = kept == proposed
        if kept > 0 and kept == proposed:
            self.pause = 4


@dataclass
class SpecCounts:
    """Draft accounting for one request (or summed over many)."""

    proposals: int = 0  # verify forwards that carried drafts
    batched_proposals: int = 0  # of the proposals, those verified beside other rows (a batch's ragged step)
    draft_tokens: int = 0  # drafts proposed and verified
    accepted_tokens: int = 0  # drafts kept

    def add(self, proposed: int, kept: int, batched: bool = False) -> None:
        self.proposals += 1
        self.draft_tokens += proposed
        self.accepted_tokens += kept
        self.batched_proposals += batched

    def merge(self, other: SpecCounts) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "acceptance_rate": self.acceptance_rate}
