"""A transformers Cache whose layers write into a sequence's blocks and hand attention the pool itself.

PagedLayer.update() writes the step's K/V into positions the caller reserved in the block table (one slice copy
per block touched) and returns the layer's pool views, key/value [num_blocks, kv_heads, block_size, head_dim]:
not the [B, H, kv, d] tensors other attention functions expect, so a forward over this cache must run inside
model/attention/paged_hf.py's `paged_attention_block`, whose attention function reads the block table. Nothing is
gathered or copied per step on the GPU path (the paged kernel reads the blocks where they are).
"""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from .block_table import BlockTable
from .length_layer import LengthLayer


class PagedLayer(LengthLayer):
    def __init__(self, table: BlockTable, layer_idx: int, length: int):
        super().__init__()
        self.table, self.layer_idx = table, layer_idx
        self.length = length  # positions written before this step
        pool = table.pool
        self.keys, self.values = pool.keys(layer_idx), pool.values(layer_idx)
        self.dtype, self.device = pool.storage.dtype, pool.storage.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        # key_states [1, kv_heads, q, d] -> positions [length, length + q), reserved by the caller
        if key_states.shape[0] != 1:
            raise ValueError(f"a paged cache layer holds one sequence; got a batch of {key_states.shape[0]}")
        n = key_states.shape[-2]
        self.table.write(self.layer_idx, self.length, key_states[0], value_states[0])
        self.length += n
        return self.keys, self.values


def paged_cache(table: BlockTable, length: int) -> Cache:
    """A Cache over `table` whose next forward writes from position `length` (the table must already hold the
    positions the forward writes: BlockTable.reserve)."""
    return Cache(layers=[PagedLayer(table, i, length) for i in range(table.pool.layout.layers)])
