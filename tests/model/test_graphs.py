"""model/graphs.py: a capture is refused (before anything is captured) when the device is nearly full."""
from __future__ import annotations

import pytest
import torch

from kvboost.model.graphs import CaptureFailed, GraphSteps, RunnerStats, capture_refusal, capture_step


def test_a_capture_is_refused_when_the_device_is_nearly_full(monkeypatch):
    """On an H100 filled by other processes a capture that ran out of memory aborted the process; the runners now
    check first, and auto mode then runs the step eagerly (an eager forward that runs out of memory raises)."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (100 << 20, 80 << 30))
    reason = capture_refusal(torch.device("cuda"))
    assert reason is not None and "100 MiB" in reason
    ran = []
    with pytest.raises(CaptureFailed, match="100 MiB") as failed:
        capture_step(lambda: ran.append(1), torch.device("cuda"))
    assert not ran and isinstance(failed.value.cause, RuntimeError)  # refused before the step ran at all
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2 << 30, 80 << 30))
    assert capture_refusal(torch.device("cuda")) is None


class _Step:
    graph = None
    logits = None


class _Runner(GraphSteps):
    """GraphSteps with a step that returns a constant, on a "CUDA" device whose memory reads as full."""

    def __init__(self, fallback: bool):
        self.mode, self.fallback_on_failure, self.stats, self.failure = "graphs", fallback, RunnerStats(), None
        self.forgotten = 0

    def _run(self, step):
        return torch.ones(3)

    def _device(self):
        return torch.device("cuda")

    def _forget_graphs(self):
        self.forgotten += 1


def test_a_refused_capture_runs_eagerly_in_auto_mode_and_raises_otherwise(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (100 << 20, 80 << 30))
    auto = _Runner(fallback=True)
    assert torch.equal(auto._execute(_Step()), torch.ones(3))  # noqa: SLF001 - the shared step logic under test
    assert auto.mode == "eager" and "100 MiB" in auto.failure and auto.forgotten == 1
    assert auto.stats.as_dict() == {"steps": 1, "capture_failures": 1}
    with pytest.raises(RuntimeError, match="100 MiB"):
        _Runner(fallback=False)._execute(_Step())  # noqa: SLF001
