"""A cache layer over slots of the batch's KVWorkspace: the Cache a batched forward runs with."""
from __future__ import annotations

import torch

from ..kv.length_layer import BufferLayer
from ..kv.workspace import KVWorkspace
from .prefix import SharedPrefix


class SlotLayer(BufferLayer):
    """Writes new K/V at given columns of given slots; returns views over slots [lo, hi).
    With a shared prefix of P tokens the views start at column P: kv_length counts columns from P, kv_offset = P."""

    def __init__(self, ws: KVWorkspace, layer_idx: int, slots: slice, write_cols: torch.Tensor | int, past: int,
                 prefix: SharedPrefix | None = None):
        super().__init__()
        self.ws, self.layer_idx, self.slots = ws, layer_idx, slots
        # int: one row's prefill start; tensor [rows]: each row's first new column (its length)
        self.write_cols = write_cols
        self.past = past  # the longest row's length: views end at past + the step's tokens
        self.start = prefix.length if prefix is not None else 0
        self.shared_prefix = (prefix.keys[layer_idx], prefix.values[layer_idx]) if prefix is not None else None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        k_buf, v_buf = self.ws.buffers(self.layer_idx)
        key_states, value_states = key_states.to(k_buf.dtype), value_states.to(v_buf.dtype)  # kv_dtype
        k_rows, v_rows = k_buf[self.slots], v_buf[self.slots]
        base = self.ws.base  # buffer column = position - base
        if isinstance(self.write_cols, int):
            end = self.write_cols + key_states.shape[-2]
            k_rows[:, :, self.write_cols - base:end - base].copy_(key_states)
            v_rows[:, :, self.write_cols - base:end - base].copy_(value_states)
        elif key_states.shape[-2] == 1:  # a decode step: each row's token at its own column
            rows = torch.arange(key_states.shape[0], device=key_states.device)
            k_rows[rows, :, self.write_cols - base] = key_states[:, :, 0]
            v_rows[rows, :, self.write_cols - base] = value_states[:, :, 0]
            end = self.past + 1
        else:  # a ragged verify: row i's q tokens at columns [write_cols[i], write_cols[i] + q)
            q = key_states.shape[-2]
            rows = torch.arange(key_states.shape[0], device=key_states.device)[:, None]
            cols = (self.write_cols - base)[:, None] + torch.arange(q, device=key_states.device)  # [rows, q]
            k_rows[rows, :, cols] = key_states.transpose(1, 2)  # indexed as [rows, q, H, d]
            v_rows[rows, :, cols] = value_states.transpose(1, 2)
            end = self.past + q
        self.keys, self.values = k_rows[:, :, self.start - base:end - base], v_rows[:, :, self.start - base:end - base]
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.past + query_length - self.start, self.start

    def get_seq_length(self) -> int:
        return self.past
