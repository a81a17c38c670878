"""One request whose K/V lives in host blocks (a context longer than the device may hold: device_kv_max_tokens),
brought to the device one layer at a time for each forward (kv/streamed_cache.py).

Same lifecycle as TableSequence (the engine's decode, verify and rollback calls are the same), with the model's
own attention over contiguous K/V, so outputs equal the all-resident run's. What a forward moves is counted:
`bytes_to_device` (earlier positions the device does not keep, every layer) and `bytes_to_host` (the step's own
K/V).
"""
from __future__ import annotations

import torch

from ..kv.block_table import BlockTable
from ..kv.layer_stream import Resident, Scratch
from ..kv.streamed_cache import StreamedCache
from .forward import forward_tokens
from .table_sequence import TableSequence


class StreamedSequence(TableSequence):
    def __init__(self, model: torch.nn.Module, table: BlockTable, attention: str = "model",
                 resident: Resident | None = None):
        """resident: device blocks for the sequence's first positions (their K/V is read there, not copied from
        the host again), or None: every position crosses each forward."""
        super().__init__(model, table)
        self.attention, self.resident = attention, resident
        self.device = next(model.parameters()).device
        self.scratch = Scratch()  # host-side K/V buffers every layer and forward reuses (CPU)
        self.forwards = 0
        self.bytes_to_device = 0
        self.bytes_to_host = 0

    def forward(self, tokens: list[int], start: int, all_logits: bool = False) -> torch.Tensor:
        if start > self.table.length:
            raise ValueError(f"position {start} is past the table's {self.table.length} positions")
        self.set_length(start)
        self.table.reserve(len(tokens))
        cache = StreamedCache(self.table, start, self.device, self.scratch, self.resident)
        try:
            logits = forward_tokens(self.model, tokens, cache, logits_to_keep=len(tokens) if all_logits else 1,
                                    attention=self.attention)[0]
            cache.flush()
        except BaseException:
            cache.close()
            self.table.truncate(start)
            raise
        if self.resident is not None:
            self.resident.filled = min(self.resident.capacity, start + len(tokens))
        self.forwards += 1
        self.bytes_to_device += cache.stream.bytes_to_device
        self.bytes_to_host += cache.bytes_to_host
        return logits if all_logits else logits[-1]

    def set_length(self, length: int) -> None:
        super().set_length(length)
        if self.resident is not None:
            self.resident.filled = min(self.resident.filled, length)

    def close(self) -> None:
        """The request is over: the device blocks go back to the pool (the host table is the plan's)."""
        if self.resident is not None:
            self.resident.release()
            self.resident = None
