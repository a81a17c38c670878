"""Deterministic prompt text for tests."""
from __future__ import annotations

import random

_WORDS = ("river stone lantern quiet orbit maple signal harbor copper meadow violet engine ledger "
          "canyon thistle marble pilot saffron glacier ember willow cobalt falcon prism tundra "
          "quartz summit anchor cedar nimbus garnet fjord delta basalt").split()


def words(n: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def text_with_tokens(tokenizer, n_tokens: int, seed: int = 0) -> str:
    """Text whose tokenization has at least n_tokens tokens."""
    n = max(4, n_tokens)
    while True:
        text = words(n, seed)
        if len(tokenizer(text)["input_ids"]) >= n_tokens:
            return text
        n += max(4, n // 4)
