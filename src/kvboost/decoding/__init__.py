"""Turning sampled tokens into text: EOS, stop strings, and stream-safe deltas."""
from __future__ import annotations

from ..sampling import find_stop, held_back_length


class OutputTracker:
    """Text deltas of sampled tokens, never inside a UTF-8 sequence or a possible stop string; finish state."""

    def __init__(self, tokenizer, eos_token_ids: set[int], stop: list[str], max_new_tokens: int):
        self.tokenizer, self.eos, self.stop, self.max_new_tokens = tokenizer, eos_token_ids, stop, max_new_tokens
        self.tokens: list[int] = []
        self.text, self.emitted, self.finished, self.finish_reason = "", 0, False, "length"

    def feed(self, token: int) -> str:
        """Register one sampled token; returns the new visible text (possibly empty)."""
        if token in self.eos:
            self.finished, self.finish_reason = True, "stop"
            return self._flush()
        self.tokens.append(token)
        self.text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        cut = find_stop(self.text, self.stop) if self.stop else -1
        if cut >= 0:
            self.text = self.text[:cut]
            self.finished, self.finish_reason = True, "stop"
            return self._flush()
        if len(self.tokens) >= self.max_new_tokens:
            self.finished = True
            return self._flush()
        safe = len(self.text) - held_back_length(self.text, self.stop)
        if self.text.endswith("\ufffd"):  # incomplete UTF-8: wait for the next bytes
            safe = min(safe, len(self.text.rstrip("\ufffd")))
        if safe > self.emitted:
            delta, self.emitted = self.text[self.emitted:safe], safe
            return delta
        return ""

    def _flush(self) -> str:
        delta, self.emitted = self.text[self.emitted:], len(self.text)
        return delta
