"""Weight layout for decode on CPU: each Linear weight shape stored in the order whose matrix-vector product this
machine streams fastest, measured at load. Values never change: a parameter keeps its [out, in] shape."""
from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable

import torch

Shape = tuple[int, int, torch.dtype]  # (out, in, dtype) of a Linear weight
SAMPLE_WEIGHTS = 8  # weights of one shape timed in turn, so the measurement reads memory, not cache
TRIALS = 3  # best of: timing noise on a shared machine is one-sided (slower)


def is_input_major(weight: torch.Tensor) -> bool:
    return weight.dim() == 2 and weight.stride() == (1, weight.shape[0])


def _linear_weights(model: torch.nn.Module) -> dict[int, torch.nn.Parameter]:
    found: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, torch.nn.Linear) and isinstance(weight, torch.nn.Parameter) \
                and weight.device.type != "meta" and weight.dim() == 2:
            found.setdefault(id(weight), weight)
    return found


def _seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # first touch
    best = float("inf")
    for _ in range(TRIALS):
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        best = min(best, time.perf_counter() - start)
    return best


def _products(x: torch.Tensor, weights: list[torch.Tensor]) -> Callable[[], None]:
    def run() -> None:
        for w in weights:
            torch.nn.functional.linear(x, w)
    return run


def measured_layouts(model: torch.nn.Module, budget_bytes: int = 64 << 20) -> dict[Shape, bool]:
    """For each distinct Linear weight shape: True when a one-row x @ W is faster input-major here."""
    by_shape: dict[Shape, list[torch.Tensor]] = defaultdict(list)
    for weight in _linear_weights(model).values():
        by_shape[(weight.shape[0], weight.shape[1], weight.dtype)].append(weight.detach())
    choice: dict[Shape, bool] = {}
    with torch.inference_mode():
        for (out_f, in_f, dtype), weights in by_shape.items():
            sample = weights[:SAMPLE_WEIGHTS]
            x = torch.randn(1, in_f, dtype=dtype, device=sample[0].device)
            # The same values in each order: [out, in] row-major, and [in, out] row-major viewed as [out, in].
            output_major = [w.contiguous() for w in sample]
            input_major = [w.t().contiguous().t() for w in sample]
            repeats = max(1, budget_bytes // sum(w.numel() * w.element_size() for w in sample))

            choice[(out_f, in_f, dtype)] = \
                _seconds(_products(x, input_major), repeats) < _seconds(_products(x, output_major), repeats)
    return choice


def relay_linears(model: torch.nn.Module, input_major: Callable[[Shape], bool]) -> int:
    """Re-lay every Linear weight in place into the order `input_major(shape)` picks; returns how many changed."""
    changed = 0
    for weight in _linear_weights(model).values():
        want = input_major((weight.shape[0], weight.shape[1], weight.dtype))
        if want == is_input_major(weight):
            continue
        with torch.no_grad():
            weight.data = weight.data.t().contiguous().t() if want else weight.data.contiguous()
        changed += 1
    return changed


def input_major_linears(model: torch.nn.Module) -> int:
    """Every Linear weight input-major (the order most GEMV shapes stream fastest in on CPU)."""
    return relay_linears(model, lambda shape: True)


def fastest_linear_layouts(model: torch.nn.Module) -> dict[Shape, bool]:
    """Measure (measured_layouts) and apply (relay_linears); returns the choice per shape."""
    choice = measured_layouts(model)
    relay_linears(model, lambda shape: choice[shape])
    return choice
