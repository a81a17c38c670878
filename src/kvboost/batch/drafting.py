"""How many tokens each row of a busy batch verifies in one step (a ragged verify's width q), picked for the whole
batch to maximize tokens per second: sum_i E_i(min(q - 1, drafts_i)) / verify(n * q) against n / plain(n), with E_i
from each row's AdaptiveK and costs as measured (never guessed cheap). Losing batches pause drafting, doubling."""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..decoding.speculative import MAX_SPECULATIVE_TOKENS, PROBE_K, AdaptiveK, StepCosts

REPROBE_STEPS = 256  # where no verify can pay, one probe per this many steps re-measures (costs drift)
RETRY_SHARE = 0.03  # the most of a batch's decode time that retries after a losing verify may cost


@dataclass
class RowDrafts:
    """One row's drafts this step and the AdaptiveK judging them (None: the row does not speculate)."""

    drafts: list[int]
    adaptive: AdaptiveK | None = None

    def expected_by_width(self, limit: int) -> list[float]:
        """Tokens this row emits from a step of w tokens per row (its token and up to w - 1 drafts), for w in 0..limit
        (index 0 and 1: one token): E(k) = 1 + a + ... + a^k."""
        if self.adaptive is None:
            return [1.0] * (limit + 1)
        a = self.adaptive.judged_acceptance
        return [1.0] + [self.adaptive.expected(min(w - 1, len(self.drafts)), a) for w in range(1, limit + 1)]


@dataclass
class BatchDrafting:
    """The batch's measured step costs and its choice of verify width (1: a plain step)."""

    max_pause: int = 32
    plain_s: dict[int, float] = field(default_factory=dict)  # row count -> seconds of a plain step (decaying mean)
    verify: StepCosts = field(default_factory=StepCosts)  # keyed by total tokens in the step: rows x width
    pause: int = 4
    wait: int = 0
    verifies: int = 0  # ragged verify steps run
    hopeless_steps: int = 0  # steps no verify could have paid for
    retry_due: bool = False  # the next proposing step retries one draft (a pause after a loss ended)
    # Drafts kept and proposals ending in a rejection, over every row's verifies (decaying): the rows' acceptance.
    kept: float = 0.0
    rejected: float = 0.0
    _hopeless: dict[int, bool] = field(default_factory=dict, init=False, repr=False)  # rows -> hopeless(), until timed

    def record_verify(self, total: int, seconds: float) -> None:
        """A verify of `total` tokens in all took `seconds`."""
        self.verify.record(total, seconds)
        self._hopeless.clear()

    def proposing(self, rows: int) -> bool:
        """Whether this step's rows propose at all: not before a plain step of this many rows is measured, not while
        paused, and not where no verify could pay (then one probe every REPROBE_STEPS)."""
        if rows not in self.plain_s:
            return False
        if self.wait > 0:
            self.wait -= 1
            return False
        if self.verify.base is not None and self.hopeless(rows):
            self.hopeless_steps += 1
            return self.hopeless_steps % REPROBE_STEPS == 0
        return True

    def hopeless(self, rows: int) -> bool:
        """No width beats a plain step even if every draft were kept; remembered until a step is timed again."""
        if rows not in self._hopeless:
            plain = rows / self.plain_s[rows]
            self._hopeless[rows] = all(rows * q / max(self.verify_cost(rows * q), 1e-12) <= plain
                                       for q in range(2, MAX_SPECULATIVE_TOKENS + 2))
        return self._hopeless[rows]

    def width(self, proposals: Sequence[RowDrafts], limit: int) -> int:
        """Tokens per row for this step (1 = plain), at most `limit`; call when proposing() said so."""
        n = len(proposals)
        longest = max((len(p.drafts) for p in proposals), default=0)
        limit = min(limit, longest + 1)
        if limit <= 1 or n not in self.plain_s:  # nothing to verify, or the plain step is not measured yet
            return 1
        if self.verify.base is None or self.hopeless(n):  # a verify's cost is unknown (or a re-probe): a few drafts
            return min(limit, PROBE_K + 1)
        if self.retry_due:  # a pause just ended: one draft each, to re-measure the rows' acceptance
            self.retry_due = False
            return 2
        rates = {1: n / self.plain_s[n]}
        emitted = [sum(col) for col in zip(*(p.expected_by_width(limit) for p in proposals))]  # per width
        for q in range(2, limit + 1):
            rates[q] = emitted[q] / max(self.verify_cost(n * q), 1e-12)
        best = max(rates, key=lambda q: (rates[q], -q))
        if best == 1:  # drafting does not pay now: pause, then retry with one draft to re-measure
            # Pauses keep retries under RETRY_SHARE of the decode time and double while drafting keeps losing.
            extra = max(0.0, self.verify_cost(2 * n) - self.plain_s[n])
            shortest = math.ceil(extra / (RETRY_SHARE * self.plain_s[n]))
            self.wait = max(self.pause, shortest)
            self.pause = min(max(self.max_pause, shortest), self.wait * 2)
            self.retry_due = True
        return best

    def verify_cost(self, total: int) -> float:
        """Seconds of a verify of `total` tokens: as timed, else on the fitted line, else scaled from the nearest timed
        total below, never cheaper than one above (a flat guess would pick the widest verify)."""
        c = self.verify
        below = [t for t in c.by_length if t < total]
        scaled = c.by_length[max(below)] * total / max(below) if below else None
        if total in c.by_length:
            timed = c.by_length[total]
            # Timed once: not trusted above what the totals below it say (a first run may have paid one-off costs).
            return timed if c.samples.get(total, 0) >= 2 or scaled is None else min(timed, scaled)
        if c.extra is not None and c.base is not None:  # on the fitted line
            return c.base + c.extra * (total - 2)
        return scaled if scaled is not None else c.by_length[min(c.by_length)]

    def observed(self, proposed: int, kept: int, decay: float = 0.85) -> None:
        """A row's verify of `proposed` drafts kept `kept` of them (AdaptiveK counts the same way)."""
        if proposed > 0:
            self.kept = decay * self.kept + kept
            self.rejected = decay * self.rejected + (0 if kept == proposed else 1)

    def prior(self, adaptive: AdaptiveK, weight: float = 2.5, evidence: float = 3.0) -> None:
        """Start a new row's acceptance at the rows' so far (AdaptiveK's prior weight), once there is evidence."""
        if self.kept + self.rejected >= evidence:
            a = self.kept / (self.kept + self.rejected)
            adaptive.kept, adaptive.rejected = weight * a, weight * (1 - a)

    def timed_plain(self, rows: int, seconds: float) -> None:
        old = self.plain_s.get(rows)
        self.plain_s[rows] = seconds if old is None else 0.8 * old + 0.2 * seconds
        self._hopeless.pop(rows, None)

    def timed_verify(self, rows: int, width: int, seconds: float, kept_whole: bool) -> None:
        """A ragged verify of `width` tokens per row took `seconds`; kept_whole: some row kept all its drafts."""
        self.record_verify(rows * width, seconds)
        self.verifies += 1
        if kept_whole:
            self.pause = 4
