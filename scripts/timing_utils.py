"""What the timing scripts share: the best of a few runs of a function, in ms."""
from __future__ import annotations

import time
from collections.abc import Callable


def best_ms(fn: Callable[[], object], trials: int = 5, warm: bool = True) -> float:
    """The fastest of `trials` calls of fn, in ms (after one untimed call when `warm`)."""
    if warm:
        fn()
    best = float("inf")
    for _ in range(trials):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3
