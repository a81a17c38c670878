"""model/graphs.py: a capture is refused (before anything is captured) when the device is nearly full."""
from __future__ import annotations

import pytest
import torch

from kvboost.model.graphs import CaptureFailed, capture_refusal, capture_step


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
