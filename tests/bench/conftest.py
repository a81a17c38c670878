"""Fixtures of the benchmark tests."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture
def one_thread():
    """End-to-end runs assert what was measured, not how fast: one torch thread keeps them quick on a busy
    machine, where two threads on shared cores can make every small op wait (70x seen on a 2-core box)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
