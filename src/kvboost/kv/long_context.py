"""The device memory K/V may take: the stored chunks' share (device_kv_budget_bytes) and contexts longer than the
device holds: which sequences keep their K/V in host memory (device_kv_max_tokens), the host workspace each such
sequence gets, and what streaming them cost (cache_stats()["streamed"])."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields

import torch

from .host_workspace import HostStreamStats, HostWorkspace, bytes_per_position
from .workspace import LayerShape

DEFAULT_DEVICE_KV_FRACTION = 0.3  # of the device memory free when the engine is built (device_kv_budget_bytes)
RUNNING_SHARE = 0.6
STREAMED_SHARE = 0.15


def device_kv_budget(configured: int | None, device: torch.device) -> int | None:
    """The device's budget for stored chunks (None: no host tier): as configured, else on CUDA a share of free memory"""
    if configured is not None or device.type != "cuda":
        return configured
    free, _ = torch.cuda.mem_get_info(device)
    return int(free * DEFAULT_DEVICE_KV_FRACTION)


def device_max_tokens(configured: int | None, device: torch.device, device_budget_bytes: int | None,
                      shapes: Sequence[LayerShape], dtype: torch.dtype, max_context: int | None) -> int | None:
    """The most positions of one sequence whose K/V the device holds (None: no limit): as configured; on CUDA none
    while the stored chunks and two longest contexts fit RUNNING_SHARE of free memory, else STREAMED_SHARE's worth."""
    if configured is not None:
        return configured
    if device.type != "cuda":
        return None
    per_position = bytes_per_position(shapes, dtype)
    free, _ = torch.cuda.mem_get_info(device)
    if (device_budget_bytes or 0) + 2 * (max_context or 32768) * per_position <= RUNNING_SHARE * free:
        return None
    return max(1, int(STREAMED_SHARE * free) // per_position)


@dataclass
class LongContexts:
    """Sequences over `max_device_tokens` run from host memory, their first positions kept on the device."""

    max_device_tokens: int | None
    shapes: list[LayerShape]
    dtype: torch.dtype
    device: torch.device
    max_positions: int | None = None
    # Stage K/V through device buffers: None decides by the device; True on a CPU too (tests).
    staged: bool | None = None
    sequences: int = 0
    totals: HostStreamStats = field(default_factory=HostStreamStats)
    pinned: bool | None = None  # whether the last host workspace's memory is page-locked (None: none built yet)

    def streams(self, n_positions: int) -> bool:
        return self.max_device_tokens is not None and n_positions > self.max_device_tokens

    def host_workspace(self) -> HostWorkspace:
        resident = 0
        if (self.staged or self.device.type != "cpu") and self.max_device_tokens:
            resident = self.max_device_tokens * bytes_per_position(self.shapes, self.dtype)
        self.sequences += 1
        return HostWorkspace(self.shapes, self.dtype, self.device, resident_bytes=resident, staged=self.staged,
                             max_positions=self.max_positions)

    def count(self, host: HostWorkspace) -> None:
        """A sequence is over: add what its forwards moved."""
        stats, self.pinned = host.stats, host.pinned
        for f in fields(HostStreamStats):
            setattr(self.totals, f.name, getattr(self.totals, f.name) + getattr(stats, f.name))

    def as_dict(self) -> dict:
        return {"max_device_tokens": self.max_device_tokens, "sequences": self.sequences, **asdict(self.totals),
                "pinned": self.pinned}
