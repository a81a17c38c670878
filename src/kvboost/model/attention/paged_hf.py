"""transformers wiring for attention through a block table: a forward over kv/paged_cache.py's cache.

Inside `paged_attention_block(model, table)` the model's layers call `paged_attention_forward`, which receives
the layer's pool views as key/value ([num_blocks, Hkv, block_size, d], what PagedLayer.update returns) and reads
the block table and valid length from the block's context: paged_backend.paged_dispatch runs the Triton paged
kernel where it runs, the gather path elsewhere. Masks are not built: only plain causal attention (queries are
the last q positions) is computed here, and anything else (sliding windows, softcap, sinks, position bias,
padding) raises NotImplementedError rather than computing something different.

Separate from hf.py (the contiguous workspace's wiring) so that the two registrations never see each other's
inputs: a paged forward hands attention pool views, which hf.py's functions would misread.
"""
from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function

from ...kv.block_table import BlockTable
from .paged_backend import paged_dispatch
from .switch import switched_attention

KVBOOST_PAGED = "kvboost_paged"
_UNSUPPORTED = ("softcap", "s_aux", "sinks", "sliding_window", "position_bias")


@dataclass
class PagedContext:
    """One forward's block table [1, W] and valid length [1] (after the step's positions), on the model's device."""

    tables: torch.Tensor
    lengths: torch.Tensor
    kv_len: int  # host copy of the length: how many columns the gather path reads
    backend: str | None = None
    counts: Counter = field(default_factory=Counter)


_local = threading.local()  # .ctx: PagedContext | None


def paged_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
               mask_function=causal_mask_function, attention_mask: torch.Tensor | None = None,
               **kwargs) -> None:
    """AttentionMaskInterface entry: None (bottom-right causal, applied by the attention itself), or refuse."""
    plain = (mask_function is causal_mask_function and type(q_offset) is int and type(kv_offset) is int
             and q_offset + q_length == kv_offset + kv_length)
    if not plain:
        raise NotImplementedError("attention through a block table computes plain causal attention only")
    if attention_mask is not None and not bool(attention_mask.all()):
        raise NotImplementedError("attention through a block table takes no padding")
    return None


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                            is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """AttentionInterface entry: query [1, Hq, q, d], key/value the layer's pool views. Returns ([1, q, Hq, d],
    None) as transformers expects."""
    ctx: PagedContext | None = getattr(_local, "ctx", None)
    if ctx is None:
        raise RuntimeError("paged attention runs only inside paged_attention_block()")
    unsupported = [name for name in _UNSUPPORTED if kwargs.get(name) is not None]
    if unsupported or is_causal is False or (module.training and dropout):
        raise NotImplementedError(f"attention through a block table cannot apply {unsupported or 'this call'}")
    out, used, _ = paged_dispatch(query, key, value, ctx.tables, ctx.lengths, scale=scaling, kv_len=ctx.kv_len,
                                  backend=ctx.backend)
    ctx.counts[used] += 1
    return out.transpose(1, 2), None


AttentionInterface.register(KVBOOST_PAGED, paged_attention_forward)
AttentionMaskInterface.register(KVBOOST_PAGED, paged_mask)


@contextmanager
def paged_attention_block(model: torch.nn.Module, table: BlockTable,
                          backend: str | None = None) -> Iterator[PagedContext]:
    """Run the model's forwards in this block through attention over `table` (its current blocks and length:
    reserve the step's positions first). The caller holds the lock that serializes the model's forwards."""
    device = table.pool.device
    ctx = PagedContext(table.ids()[None].to(device), torch.tensor([table.length], dtype=torch.int32, device=device),
                       table.length, backend)
    previous = getattr(_local, "ctx", None)
    _local.ctx = ctx
    try:
        with switched_attention(model, KVBOOST_PAGED):
            yield ctx
    finally:
        _local.ctx = previous


# ---- fixed-shape steps over a table (model/table_runner.py) -------------------------------------------------
KVBOOST_PAGED_STATIC = "kvboost_paged_static"


def static_paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                                   value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float = 0.0,
                                   scaling: float | None = None, is_causal: bool | None = None,
                                   **kwargs) -> tuple[torch.Tensor, None]:
    """AttentionInterface entry for a fixed-shape step: query [1, Hq, T, d] over the layer's pool views, the block
    table [1, W] and valid length [1] read from the forward's keyword arguments kvboost_tables / kvboost_ends
    (device tensors filled before each step: no thread-local state, no host value). Registered without a mask
    function, as static.py's KVBOOST_STATIC: transformers then builds no mask; causality comes from the ends."""
    tables, ends = kwargs.get("kvboost_tables"), kwargs.get("kvboost_ends")
    if tables is None or ends is None:
        raise ValueError(f"{KVBOOST_PAGED_STATIC} attention needs kvboost_tables and kvboost_ends (a table step)")
    unsupported = [name for name in _UNSUPPORTED if kwargs.get(name) is not None]
    if attention_mask is not None or unsupported or is_causal is False or (module.training and dropout):
        raise NotImplementedError(f"a table step runs plain causal attention only, not {unsupported or 'a mask'}")
    out, _, _ = paged_dispatch(query, key, value, tables, ends, scale=scaling, backend=kwargs.get("kvboost_backend"))
    return out.transpose(1, 2), None


AttentionInterface.register(KVBOOST_PAGED_STATIC, static_paged_attention_forward)


@contextmanager
def static_paged_attention(model: torch.nn.Module) -> Iterator[None]:
    """Inside the block the model attends with KVBOOST_PAGED_STATIC; pass kvboost_tables, kvboost_ends (and
    optionally kvboost_backend) to the model's forward."""
    with switched_attention(model, KVBOOST_PAGED_STATIC):
        yield
