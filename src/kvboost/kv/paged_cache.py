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
from .blocks import BlockPool
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


class StaticPagedLayer(LengthLayer):
    """A paged layer whose every shape is fixed (model/table_runner.py: a CUDA graph replays it at any position):
    the step's K/V [1, kv_heads, T, d] go to the pool rows in `rows` ([kv_heads * T] int64, a device tensor the
    runner fills before each step; see static_pool_rows) with one index_copy_ per tensor, as kv/static.py's
    StaticLayer writes the workspace. Returns the layer's pool views, like PagedLayer."""

    is_compileable = True

    def __init__(self, pool: BlockPool, layer_idx: int, rows: torch.Tensor, length: int = 0):
        super().__init__()
        self.layer_idx, self.rows, self.length = layer_idx, rows, length
        self.keys, self.values = pool.keys(layer_idx), pool.values(layer_idx)
        self.flat = pool.storage.view(-1, pool.layout.head_dim)  # one row per (block, layer, K/V, head, slot)
        # Row offset of this layer's K (and V) from layer 0's K, for the same block, head and slot.
        h, bs = pool.layout.kv_heads, pool.layout.block_size
        self.k_offset, self.v_offset = (2 * layer_idx) * h * bs, (2 * layer_idx + 1) * h * bs
        self.dtype, self.device = pool.storage.dtype, pool.storage.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        d = key_states.shape[-1]
        self.flat.index_copy_(0, self.rows + self.k_offset, key_states[0].reshape(-1, d))  # [H * T, d]
        self.flat.index_copy_(0, self.rows + self.v_offset, value_states[0].reshape(-1, d))
        return self.keys, self.values


def static_pool_rows(pool: BlockPool, slots: torch.Tensor) -> torch.Tensor:
    """Flat slots [T] (block * block_size + offset) -> layer 0's K rows [kv_heads * T] of `pool.storage` viewed as
    [-1, head_dim], head-major like key_states[0].reshape(-1, d)."""
    layout = pool.layout
    h, bs = layout.kv_heads, layout.block_size
    block, offset = slots // bs, slots % bs
    per_block = layout.layers * 2 * h * bs  # rows of one block
    heads = torch.arange(h, device=slots.device)[:, None] * bs  # [H, 1]
    return (block * per_block + offset)[None, :].add(heads).reshape(-1)


def static_paged_cache(pool: BlockPool, rows: torch.Tensor, length: int = 0) -> Cache:
    return Cache(layers=[StaticPagedLayer(pool, i, rows, length) for i in range(pool.layout.layers)])
