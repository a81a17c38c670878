"""A transformers Cache over a host block table whose layers bring their K/V to the device one at a time.

StreamedLayer.update() hands attention the layer's K/V of every earlier position (LayerStream: from host blocks,
or the device blocks of the first positions)
followed by the step's own, as a contiguous [1, kv_heads, n + q, d] tensor - what a workspace layer hands it, so
the model's own attention (masks included) runs unchanged - and writes the step's K/V into the table's reserved
host positions (and into the device blocks of the sequence's first positions, while they have room). On CUDA the
host writes go first to pinned buffers (asynchronous copies; a blocking one per layer would stall the pipeline)
and reach the blocks in flush(), after the forward.
"""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from .block_table import BlockTable
from .layer_stream import LayerStream, Resident, Scratch
from .length_layer import LengthLayer


class StreamedLayer(LengthLayer):
    def __init__(self, cache: StreamedCache, layer_idx: int):
        super().__init__()
        self.owner, self.layer_idx = cache, layer_idx
        self.length = cache.start
        pool = cache.table.pool
        self.dtype, self.device = pool.storage.dtype, cache.stream.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        # key_states [1, kv_heads, q, d] -> positions [length, length + q), reserved by the caller
        if key_states.shape[0] != 1:
            raise ValueError(f"a streamed cache layer holds one sequence; got a batch of {key_states.shape[0]}")
        if self.length != self.owner.start:
            raise RuntimeError("a streamed cache layer runs one forward; build a new cache for the next")
        q = key_states.shape[-2]
        keys, values = self.owner.stream.take(self.layer_idx, q)
        keys[:, :, self.length:].copy_(key_states)
        values[:, :, self.length:].copy_(value_states)
        self.owner.keep(self.layer_idx, key_states[0], value_states[0])
        self.length += q
        return keys, values


class StreamedCache(Cache):
    """One forward's cache over `table` (positions [start, start + q) already reserved)."""

    def __init__(self, table: BlockTable, start: int, device: torch.device, scratch: Scratch | None = None,
                 resident: Resident | None = None):
        self.table, self.start, self.resident = table, start, resident
        self.stream = LayerStream(table, start, device, scratch, resident)
        self.transfers = self.stream.transfers  # staged (CUDA): the step's K/V reaches the host blocks in flush()
        self.outbox: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # CUDA: (layer, K, V) in pinned memory
        self.bytes_to_host = 0
        super().__init__(layers=[StreamedLayer(self, i) for i in range(table.pool.layout.layers)])

    def keep(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """The step's K/V [kv_heads, q, d] of `layer` into the table (CUDA: queued, see flush)."""
        self.bytes_to_host += (keys.numel() + values.numel()) * self.table.pool.storage.element_size()
        if self.resident is not None:
            self.resident.keep(layer, self.start, keys, values)
        if self.transfers is None:
            self.table.write(layer, self.start, keys, values)
            return
        pinned = []
        for t in (keys, values):
            host = self.transfers.host_buffer(t.shape, self.table.pool.storage.dtype)
            host.copy_(t, non_blocking=True)
            pinned.append(host)
        self.outbox.append((layer, pinned[0], pinned[1]))

    def flush(self) -> None:
        """The queued writes into the table's blocks (after the device finished them)."""
        if self.outbox:
            assert self.transfers is not None
            self.transfers.synchronize()
            for layer, keys, values in self.outbox:
                self.table.write(layer, self.start, keys, values)
            self.outbox.clear()

    def close(self) -> None:
        self.outbox.clear()
        self.stream.close()
