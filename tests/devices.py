"""The device the suite runs on (`pytest --device cuda`, default cpu) and helpers to keep tensors on it.

tests/conftest.py parses --device once (parse_device), calls set_current(), and exposes the session fixture
`device`. Helpers that are not fixtures (tiny_models.make_tiny_model, module-level model caches) read
current(). A test builds its tensors on the model's device (`torch.tensor(ids, device=model.device)`) or on
the `device` fixture, never on the implicit CPU default, and can check results with assert_on().
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

_current = torch.device("cpu")


def parse_device(name: str) -> torch.device:
    """torch.device for a --device value that this machine can run, else ValueError saying why."""
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise ValueError(f"--device {name!r} is not a torch device: {exc}") from None
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            built = torch.version.cuda or "none (a CPU-only torch build)"
            raise ValueError(f"--device {name}: no CUDA device is available here (torch {torch.__version__}, "
                             f"CUDA runtime {built}); run on a GPU machine or use --device cpu")
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise ValueError(f"--device {name}: this machine has {count} CUDA device(s) (cuda:0..cuda:{count - 1})")
        return torch.device("cuda", dev.index if dev.index is not None else torch.cuda.current_device())
    if dev.type == "mps":
        if not (getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()):
            raise ValueError(f"--device {name}: MPS is not available on this machine")
        return torch.device("mps")
    raise ValueError(f"--device {name}: unsupported device type {dev.type!r}; expected cpu, cuda, cuda:N or mps")


def set_current(device: torch.device) -> None:
    global _current
    _current = torch.device(device)


def current() -> torch.device:
    """The suite's device (what --device chose); cpu outside a pytest session."""
    return _current


def same_device(a: torch.device | str, b: torch.device | str) -> bool:
    """cuda and cuda:0 (the current CUDA device) are the same device; an index left out matches any index."""
    a, b = torch.device(a), torch.device(b)
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def _flatten(items: Iterable) -> Iterable[torch.Tensor]:
    for t in items:
        if isinstance(t, torch.Tensor):
            yield t
        elif isinstance(t, (list, tuple)):
            yield from _flatten(t)
        elif isinstance(t, dict):
            yield from _flatten(t.values())
        elif t is not None:
            raise TypeError(f"assert_on expects tensors (or lists/tuples/dicts of them), got {type(t).__name__}")


def assert_on(device: torch.device | str, *tensors) -> None:
    """Every tensor (nested lists/tuples/dicts allowed; None skipped) lives on `device`."""
    seen = 0
    for i, t in enumerate(_flatten(tensors)):
        seen += 1
        assert same_device(t.device, device), f"tensor #{i} {tuple(t.shape)} is on {t.device}, expected {device}"
    assert seen, "assert_on got no tensors"


def model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device
