"""A cache over the workspace whose every shape is fixed, as CUDA graphs and torch.compile need: writes go to positions
held in a device tensor and attention gets the whole buffer with device-side valid ends (model/attention/hf.py)."""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from .length_layer import LengthLayer
from .workspace import KVWorkspace


class StaticLayer(LengthLayer):
    """One layer's K/V buffers [B, kv_heads, capacity, d], written at `positions`: [q] int64, the same columns
    for every row (a prefill or a batch-1 step), or [B, 1], one token per row at its own column (batch decode)."""

    is_compileable = True

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, length: int):
        super().__init__()
        self.keys, self.values, self.positions = keys, values, positions
        self.dtype, self.device = keys.dtype, keys.device
        # Tokens before this step: transformers sizes masks from it, but the attention ignores them (a None mask).
        self.length = length

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        # key_states [B, kv_heads, q, d] -> buffer columns `positions` of every row, in the buffers' dtype (kv_dtype)
        key_states, value_states = key_states.to(self.dtype), value_states.to(self.dtype)
        if self.positions.dim() == 1:
            self.keys.index_copy_(2, self.positions, key_states)
            self.values.index_copy_(2, self.positions, value_states)
        else:  # scatter, not index_put: no host sync, so a graph can capture it
            index = self.positions[:, None, :, None].expand(-1, key_states.shape[1], -1, key_states.shape[-1])
            self.keys.scatter_(2, index, key_states)
            self.values.scatter_(2, index, value_states)
        return self.keys, self.values

    def get_max_length(self) -> int:
        return self.keys.shape[-2]


def static_cache(workspace: KVWorkspace, positions: torch.Tensor, length: int = 0, rows: int = 1) -> Cache:
    """A Cache writing into the first `rows` rows of every layer of `workspace` (base 0) at `positions`."""
    if workspace.base:
        raise ValueError("a static cache needs a workspace whose columns start at position 0")
    if rows > workspace.batch_size:
        raise ValueError(f"{rows} rows but the workspace has {workspace.batch_size}")
    buffers = [workspace.buffers(i) for i in range(len(workspace.shapes))]
    return Cache(layers=[StaticLayer(k[:rows], v[:rows], positions, length) for k, v in buffers])


def set_length(cache: Cache, length: int) -> None:
    """Tell every layer of a static cache how many tokens precede the next step (host bookkeeping only)."""
    for layer in cache.layers:
        layer.length = length


def set_views(cache: Cache, workspace: KVWorkspace, end: int | None, rows: int = 1) -> None:
    """Point every layer of a static cache of `rows` rows at its buffers' first `end` columns, [rows, kv_heads, end, d]
    (None: all). One row reads exactly the valid keys with no mask; more rows are masked to their own ends."""
    for i, layer in enumerate(cache.layers):
        k, v = workspace.buffers(i)
        layer.keys, layer.values = k[:rows, :, :end], v[:rows, :, :end]
        for view in (layer.keys, layer.values):
            torch._dynamo.maybe_mark_dynamic(view, 2)
            if rows > 1:
                torch._dynamo.maybe_mark_dynamic(view, 0)
