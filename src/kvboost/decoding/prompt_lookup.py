"""Prompt lookup (n-gram) drafts: what followed the last n tokens where they occurred before (longest n first, earliest
occurrence, as in HF), found by vectorized comparisons over a growing buffer: no index, so nothing costs at TTFT."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class PromptLookup:
    def __init__(self, prompt: Sequence[int], max_ngram: int = 3, min_ngram: int = 1, capacity: int = 0):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self._buf = np.empty(max(len(prompt) + capacity, 16), dtype=np.int64)
        self._buf[: len(prompt)] = prompt
        self.length = len(prompt)

    @property
    def tokens(self) -> np.ndarray:
        return self._buf[: self.length]

    def extend(self, tokens: Sequence[int]) -> None:
        n = len(tokens)
        if self.length + n > len(self._buf):
            grown = np.empty(max(2 * len(self._buf), self.length + n), dtype=np.int64)
            grown[: self.length] = self._buf[: self.length]
            self._buf = grown
        self._buf[self.length:self.length + n] = tokens
        self.length += n

    def propose(self, k: int, min_ngram: int | None = None) -> list[int]:
        """Up to k tokens that followed the longest earlier occurrence of the context's last n tokens; [] when none."""
        ctx, L = self.tokens, self.length
        if k <= 0:
            return []
        floor = self.min_ngram if min_ngram is None else max(1, min(min_ngram, self.max_ngram))
        for n in range(min(self.max_ngram, L - 1), floor - 1, -1):
            # Windows starting at s < L - n: a match is followed by a token and is never the suffix itself.
            m = L - n
            hit = ctx[:m] == ctx[L - n]
            for j in range(1, n):
                hit &= ctx[j:m + j] == ctx[L - n + j]
            starts = np.flatnonzero(hit)
            if starts.size:
                begin = int(starts[0]) + n
                return ctx[begin:begin + k].tolist()
        return []
