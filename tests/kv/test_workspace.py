"""KVWorkspace: positions map to buffer columns through `base`, so a batch can skip a shared prefix's columns."""
from __future__ import annotations

import functools

import pytest
import torch

from kvboost.kv.workspace import KVWorkspace, LayerShape

from ..devices import assert_on

SHAPES = [LayerShape(kv_heads=2, head_dim_k=4, head_dim_v=4)] * 3


def _kv(n: int, fill: float, device: torch.device) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return ([torch.full((2, n, 4), fill + i, device=device) for i in range(3)],
            [torch.full((2, n, 4), -fill - i, device=device) for i in range(3)])


def test_rebase_keeps_positions_and_frees_the_columns_below_base(device):
    full = functools.partial(torch.full, device=device)
    ws = KVWorkspace(SHAPES, torch.float32, device, batch_size=2)
    ws.ensure_capacity(64, keep=0)
    assert_on(device, ws.buffers(0))
    ws.write(*_kv(40, 1.0, device), start=0)
    full_bytes, cap = ws.nbytes, ws.capacity
    ws.rebase(16, keep=40)
    assert ws.base == 16 and ws.capacity == cap and ws.nbytes == full_bytes * (cap - 16) // cap
    keys, values = ws.read(16, 40, row=1)
    assert_on(device, keys, values)
    assert all(torch.equal(k, full((2, 24, 4), 1.0 + i)) for i, k in enumerate(keys))
    with pytest.raises(ValueError, match="below this workspace's first position 16"):
        ws.read(8, 20)
    # Back down: the re-exposed positions start zeroed for the caller to fill; one row at a time.
    ws.rebase(8, keep=40)
    assert ws.read(8, 16, row=0)[0][0].abs().sum() == 0
    ws.write(*_kv(8, 5.0, device), start=8, row=0)
    assert torch.equal(ws.read(8, 16, row=0)[0][2], full((2, 8, 4), 7.0))
    assert ws.read(8, 16, row=1)[0][2].abs().sum() == 0
    assert torch.equal(ws.read(16, 40, row=0)[1][0], full((2, 24, 4), -1.0))
    # Growth keeps the base and what is held.
    ws.ensure_capacity(300, keep=40)
    assert ws.base == 8 and ws.capacity >= 300 and torch.equal(ws.read(16, 40, row=1)[0][1], full((2, 24, 4), 2.0))
    ws.release()
    assert ws.base == 0 and ws.nbytes == 0


def test_in_place_cache_layers_need_base_zero(device):
    ws = KVWorkspace(SHAPES, torch.float32, device)
    ws.rebase(4)
    with pytest.raises(ValueError, match="position 0"):
        ws.make_cache(4)


def test_records_from_a_cpu_tier_are_written_onto_the_workspace_device(device):
    """Disk and Redis tiers hand back CPU tensors; writing them into a device workspace must just work."""
    ws = KVWorkspace(SHAPES, torch.float32, device)
    ws.ensure_capacity(16, keep=0)
    ws.write(*_kv(8, 3.0, torch.device("cpu")), start=4)
    keys, values = ws.read(4, 12)
    assert_on(device, keys, values)
    assert torch.equal(values[1].cpu(), torch.full((2, 8, 4), -4.0))
