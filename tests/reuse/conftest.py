"""Reuse tests run tiny models: one intra-op thread.

On a shared 2-core box, two OpenMP threads contending with other processes make the many small ops of a
64-wide model 50x slower than one thread (barrier spins); these tests measure correctness, not throughput.
"""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
