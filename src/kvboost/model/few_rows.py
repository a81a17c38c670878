"""Linear products of a few rows on a CPU: W @ x^T (transposed back) instead of x @ W^T, where measured faster.

A forward of 2 to 16 token rows (a speculative verify, a short suffix, a batched decode step) multiplies every
weight by a few rows. On the CPU build's BLAS the usual form, x [r, in] @ W^T, ran single-threaded for such r
here, while the same product written as W [out, in] @ x^T (a tall matrix times a few columns) is split over
`out` (SmolLM2-135M over 1,100 cached tokens, whole forward, 2 threads: 2 rows 94 -> 55 ms, 4 rows 95 -> 59,
8 rows 94 -> 81, 16 rows 114 -> 100; 1 thread: 2 rows 100 -> 81, 4 rows 102 -> 88, but 8 rows 121 -> 134).
Which form wins depends on the BLAS, the CPU and the thread count, so nothing is assumed: each bucket of row
counts runs its first forwards both ways, timed, and keeps the faster form (`FewRowLinears.stats()`).
The values are the same products summed in another order: they differ from x @ W^T in the last bits, as the
products of any two row counts already do.

Only plain `torch.nn.Linear` modules (not subclasses: quantized layers have their own forward) of a CPU model
without accelerate hooks are swapped, and only for the duration of one forward (the caller holds the lock that
serializes the model's forwards, as for the attention switch).
"""
from __future__ import annotations

import time
import types
import weakref
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch

MAX_ROWS = 16
BUCKETS = ((2, 2), (3, 4), (5, 8), (9, MAX_ROWS))
TRIALS = 2  # timed forwards per form and bucket before the faster is kept (the minimum of each)


def _transposed_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // x.shape[-1]
    out = torch.mm(self.weight, x.reshape(rows, x.shape[-1]).t()).t().contiguous()  # [rows, out]
    if self.bias is not None:
        out += self.bias
    return out.view(*x.shape[:-1], self.out_features)


@dataclass
class _Bucket:
    times: dict[bool, list[float]] = field(default_factory=lambda: {False: [], True: []})  # swapped -> seconds
    choice: bool | None = None  # True: W @ x^T; None: still measuring

    def next_form(self) -> bool:
        if self.choice is not None:
            return self.choice
        return len(self.times[False]) > len(self.times[True])  # alternate, plain first

    def timed(self, swapped: bool, seconds: float) -> None:
        if self.choice is not None:
            return
        self.times[swapped].append(seconds)
        if min(len(t) for t in self.times.values()) >= TRIALS:
            self.choice = min(self.times[True]) < min(self.times[False])


class FewRowLinears:
    """One model's measured choice per bucket of row counts, and the swap itself."""

    def __init__(self, model: torch.nn.Module):
        self.linears = [m for m in model.modules() if type(m) is torch.nn.Linear and m.weight.dim() == 2]
        self.buckets = {b: _Bucket() for b in BUCKETS}

    @staticmethod
    def bucket_of(rows: int) -> tuple[int, int] | None:
        return next((b for b in BUCKETS if b[0] <= rows <= b[1]), None)

    @contextmanager
    def forward(self, rows: int) -> Iterator[None]:
        """One forward of `rows` token rows: swapped or not as measured (timed while the bucket is measuring)."""
        key = self.bucket_of(rows)
        if key is None or not self.linears:
            yield
            return
        bucket = self.buckets[key]
        swapped = bucket.next_form()
        if swapped:
            for m in self.linears:
                m.forward = types.MethodType(_transposed_forward, m)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if swapped:
                for m in self.linears:
                    del m.forward
        bucket.timed(swapped, time.perf_counter() - t0)

    def stats(self) -> dict:
        """Per bucket ("2-2", "3-4", ...): the kept form ("W @ x^T" / "x @ W^T", None while measuring) and the best
        ms measured each way."""
        def best(ts: list[float]) -> float | None:
            return 1e3 * min(ts) if ts else None

        return {f"{lo}-{hi}": {"form": None if b.choice is None else ("W @ x^T" if b.choice else "x @ W^T"),
                               "plain_ms": best(b.times[False]), "transposed_ms": best(b.times[True])}
                for (lo, hi), b in self.buckets.items()}


_by_model: weakref.WeakKeyDictionary[torch.nn.Module, FewRowLinears | None] = weakref.WeakKeyDictionary()


def few_row_linears(model: torch.nn.Module) -> FewRowLinears | None:
    """The model's FewRowLinears (made on first use), or None where it does not apply: off the CPU, or a model
    whose modules carry accelerate hooks (their forward is already replaced)."""
    if model not in _by_model:
        param = next(model.parameters(), None)
        hooked = getattr(model, "hf_device_map", None) is not None or any(
            "forward" in vars(m) for m in model.modules())
        _by_model[model] = None if param is None or param.device.type != "cpu" or hooked else FewRowLinears(model)
    return _by_model[model]


def few_rows_context(model: torch.nn.Module, rows: int):
    """The block one eager forward of `rows` token rows runs in (a no-op where the swap does not apply)."""
    linears = few_row_linears(model)
    return nullcontext() if linears is None else linears.forward(rows)
