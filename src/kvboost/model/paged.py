"""A forward over a block table: the K/V of earlier positions is read from the table's blocks, the step's K/V is
written into the table (kv/paged_cache.py, model/attention/paged_hf.py). No workspace: an exact hit mapped into
the table (kv/paged_kv.py) is attended where it is stored."""
from __future__ import annotations

import torch

from ..kv.block_table import BlockTable
from ..kv.paged_cache import paged_cache
from .cache_arg import cache_kwargs


def paged_forward(model: torch.nn.Module, token_ids: list[int], table: BlockTable, *, backend: str | None = None,
                  logits_to_keep: int = 1) -> torch.Tensor:
    """Run token_ids at positions [table.length, ...) over the table; returns float32 logits of the last
    `logits_to_keep` positions, [1, logits_to_keep, vocab]. The table grows by len(token_ids) positions (copy on
    write of a shared partial last block first); if the forward raises, it is cut back."""
    from .attention.paged_hf import paged_attention_block

    start = table.length
    table.reserve(len(token_ids))
    try:
        ids = torch.tensor([token_ids], dtype=torch.long, device=next(model.parameters()).device)
        with paged_attention_block(model, table, backend=backend):
            out = model(input_ids=ids, **cache_kwargs(paged_cache(table, start)), use_cache=True,
                        logits_to_keep=logits_to_keep)
    except BaseException:
        table.truncate(start)
        raise
    return out.logits.float()
