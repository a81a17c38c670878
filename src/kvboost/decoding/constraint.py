"""Per-sequence grammar state applied to logits as a mask: mask() before choosing, advance() after; accepts() and
rollback() let a verifier check and undo drafts. EOS is allowed exactly where the grammar may terminate."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import KVBoostError
from .closing import CLOSING_MARGIN, HORIZON, ClosingPlanner, ClosingVocab


class GrammarViolationError(KVBoostError, RuntimeError):
    """A token the grammar does not allow was committed (a bug: the mask should have prevented it)."""


class TokenConstraint:
    def __init__(self, compiled, vocab_size: int, stop_token_ids: Sequence[int], budget: int | None = None,
                 closing: ClosingVocab | None = None):
        """budget: max_new_tokens; with `closing` the last tokens finish the output rather than cut it."""
        import xgrammar as xgr

        self._xgr = xgr
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=list(stop_token_ids) or None)
        self.vocab_size = vocab_size
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)  # int32 on the CPU, where xgrammar fills it
        self._device_bitmask: torch.Tensor | None = None
        self.budget, self.emitted, self.forced = budget, 0, 0  # tokens advanced; of them, forced to close
        self.closing_started = False
        self._closing = ClosingPlanner(self.matcher, vocab_size, stop_token_ids, closing) \
            if budget is not None and closing is not None else None

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [vocab] with every forbidden token at -inf: in place if contiguous float32, else in a float32 copy."""
        out = logits if logits.dtype == torch.float32 and logits.is_contiguous() else logits.float().contiguous()
        forced = self._closing_token()
        if forced is not None:
            row = out.reshape(-1)
            kept = row[forced].clone()
            row.fill_(float("-inf"))
            row[forced] = kept
            return out
        self.matcher.fill_next_token_bitmask(self.bitmask)
        row = out.reshape(1, -1)
        bitmask = self.bitmask
        if out.device.type != "cpu":
            if self._device_bitmask is None or self._device_bitmask.device != out.device:
                self._device_bitmask = torch.empty_like(bitmask, device=out.device)
            self._device_bitmask.copy_(bitmask, non_blocking=True)
            bitmask = self._device_bitmask
        # The mask covers vocab_size (maybe padded) tokens; on CPU "auto" would pick a much slower torch path.
        backend = "cpu" if out.device.type == "cpu" else "auto"
        self._xgr.apply_token_bitmask_inplace(row, bitmask, vocab_size=min(self.vocab_size, row.shape[-1]),
                                              backend=backend)
        if row.shape[-1] > self.vocab_size:
            row[:, self.vocab_size:] = float("-inf")
        return out

    def accepts(self, token: int) -> bool:
        """Whether token may come next, leaving the state as it was."""
        return self.accepted_prefix([token]) == 1

    def accepted_prefix(self, tokens: Sequence[int]) -> int:
        """How many of tokens, in order, the grammar allows from here (the state is left as it was)."""
        n = 0
        for token in tokens:
            if self.matcher.is_terminated() or not self.matcher.accept_token(int(token)):
                break
            n += 1
        if n:
            self.matcher.rollback(n)  # not self.rollback: these were never advanced, so `emitted` stays
        return n

    def advance(self, token: int) -> None:
        if not self.matcher.accept_token(int(token)):
            raise GrammarViolationError(f"token {token} is not allowed by the output format here")
        self.emitted += 1

    def rollback(self, n: int) -> None:
        """Undo the last n advanced tokens (xgrammar keeps the whole history: any n up to the tokens advanced)."""
        if n > 0:
            self.matcher.rollback(n)
            self.emitted -= n

    def _closing_token(self) -> int | None:
        """The token that must come next to finish within the budget, or None (the model picks); counted in `forced`."""
        if self._closing is None or self.matcher.is_terminated():
            return None
        left = self.budget - self.emitted
        if not self.closing_started and not 0 < left <= HORIZON:
            return None
        plan = self._closing.plan(HORIZON)
        if plan is None or (not self.closing_started and (not plan or len(plan) + CLOSING_MARGIN < left)):
            return None  # nothing to close (the output may end here), or still room for the model's own tokens
        self.closing_started = True
        token = plan[0] if plan else self._closing.stop_token()
        if token is not None:
            self.forced += 1
        return token

    @property
    def finished(self) -> bool:
        """The grammar accepted a stop token: nothing more may follow."""
        return self.matcher.is_terminated()
