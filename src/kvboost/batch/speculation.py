"""Speculation for the scheduler's rows: a row alone verifies its drafts over its slot; beside other rows, a ragged
step verifies every row's drafts at once (q per row, drafting.py). A seeded row's output is its non-speculative one."""
from __future__ import annotations

import time
from functools import partial
from typing import TYPE_CHECKING

from ..decoding import factory
from ..decoding.speculative import StepCosts
from ..decoding.speculator import Speculator
from ..sampling import sample_rows
from .drafting import BatchDrafting, RowDrafts
from .rows import Row

if TYPE_CHECKING:
    from ..scheduler import Scheduler


class RowSpeculation:
    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self.drafting = BatchDrafting()

    def speculator(self, row: Row) -> Speculator | None:
        """The row's Speculator (None: it decodes plainly), after its prefill."""
        request = row.request
        params = request.speculative
        if params is None:
            return None
        engine = self.scheduler.engine
        costs = engine.spec_costs.setdefault(params.method, StepCosts())  # one per engine and method
        proposer = factory.make_proposer(engine, request, row.ids + [row.next_token], costs)
        # A bound method, not a closure: a row -> speculator -> row cycle would keep the plan alive until GC.
        forward = self.scheduler.forward_alone if row.host is None else partial(row.host.forward, all_logits=True)
        spec = Speculator(proposer, row.sampler, params, forward, costs)
        self.drafting.prior(spec.adaptive)
        return spec

    # ---- alone: the row's own verify --------------------------------------------------------------------------
    def alone(self, row: Row) -> None:
        assert row.spec is not None
        drafted, kept = row.spec.counts.draft_tokens, row.spec.counts.accepted_tokens
        out = row.spec.step(row.next_token, row.length, row.tracker.max_new_tokens - len(row.tracker.tokens))
        self.drafting.observed(row.spec.counts.draft_tokens - drafted, row.spec.counts.accepted_tokens - kept)
        row.length += len(out)  # the fed token and the kept drafts; rejected drafts' K/V lies past it
        row.next_token = out[-1]
        self.scheduler.emit(row, out)

    # ---- beside other rows: ragged verify steps ---------------------------------------------------------------
    def verify_together(self, rows: list[Row]) -> bool:
        """Verify the rows' drafts in one ragged step if drafting pays now; False: the caller runs a plain step."""
        scheduler = self.scheduler
        if scheduler.forwards.ragged_mask is None or not any(r.spec is not None for r in rows) \
                or not self.drafting.proposing(len(rows)):
            return False
        proposals = [RowDrafts([]) if row.spec is None else
                     RowDrafts(row.spec.drafts(min(row.spec.params.num_tokens,
                                                   row.tracker.max_new_tokens - len(row.tracker.tokens) - 1)),
                               row.spec.adaptive) for row in rows]
        room = scheduler.engine.max_context - max(r.length for r in rows) if scheduler.engine.max_context else 1 << 30
        width = self.drafting.width(proposals, room)
        if width <= 1:
            return False
        self._verify_rows(rows, proposals, width, room)
        return True

    def timed_plain(self, rows: list[Row], t0: float) -> None:
        """A plain step of these rows, started at t0, is done: the yardstick for verify widths."""
        if len(rows) > 1 and any(r.spec is not None for r in rows):
            self.drafting.timed_plain(len(rows), time.perf_counter() - t0)

    def _verify_rows(self, rows: list[Row], proposals: list[RowDrafts], width: int, room: int) -> None:
        """One forward of `width` tokens per row (its token, then drafts cut to width - 1, padded); each speculating row
        keeps what its sampler accepts. With a runner the width is rounded to one of its steps' widths."""
        scheduler = self.scheduler
        t0 = time.perf_counter()
        lengths = [r.length for r in rows]
        runner = scheduler.runner if scheduler.prefix is None else None
        fixed = runner.verify_width(len(rows), width) if runner is not None else None
        if fixed is not None and fixed <= room:
            width = fixed
        else:
            runner = None
        drafts = [p.drafts[:width - 1] for p in proposals]
        tokens = [[r.next_token, *d, *[r.next_token] * (width - 1 - len(d))] for r, d in zip(rows, drafts)]
        logits = runner.verify_batch(tokens, lengths) if runner is not None else \
            scheduler.forwards.ragged(tokens, lengths)  # [n, width, vocab]
        plain = [i for i, r in enumerate(rows) if r.spec is None]
        picks = dict(zip(plain, sample_rows([rows[i].sampler for i in plain], logits[plain, 0]))) if plain else {}
        outs = [[picks[i]] if row.spec is None else row.spec.accept(logits[i, :len(d) + 1], d, batched=True)
                for i, (row, d) in enumerate(zip(rows, drafts))]
        for d, out in zip(drafts, outs):
            self.drafting.observed(len(d), len(out) - 1)
        kept_whole = any(d and len(out) == len(d) + 1 for d, out in zip(drafts, outs))
        self.drafting.timed_verify(len(rows), width, time.perf_counter() - t0, kept_whole)
        for row, out in zip(rows, outs):  # every length first: a row leaving moves the last row's columns up to it
            row.length += len(out)
            row.next_token = out[-1]
        for row, out in list(zip(rows, outs)):
            scheduler.emit(row, out)
