"""One request's K/V as a block table (paged_kv with paged_attention="table"): no workspace.

The stored prefix a lookup mapped into the table is attended where it is stored (no placement copy); the prompt's
suffix and every decode step write their K/V into the table's own blocks (copy on write of a shared, partly filled
last block first); write-back keeps those blocks as stored chunks (no clone). A speculative verify's rejected
drafts are cut off the table (truncate). Attention runs through model/paged.py: the Triton paged kernel on CUDA,
torch paths elsewhere (on a CPU the blocks are read in place: model/attention/paged_backend.py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..kv.block_table import BlockTable
from .paged import paged_forward

if TYPE_CHECKING:
    from .table_runner import TableRunner


class TableSequence:
    """What the engine's lifecycle needs of a sequence's cache, over a block table it does not own (the plan
    holds it). runner: the engine's TableRunner (fixed-shape steps, CUDA graphs on a GPU) for forwards that fit
    its buckets; longer ones (and every one without it) run model/paged.py's eager forward."""

    def __init__(self, model: torch.nn.Module, table: BlockTable, backend: str | None = None,
                 runner: TableRunner | None = None):
        self.model, self.table, self.backend, self.runner = model, table, backend, runner

    @property
    def length(self) -> int:
        return self.table.length

    def forward(self, tokens: list[int], start: int, all_logits: bool = False) -> torch.Tensor:
        """Run tokens at positions [start, start + n) after the table's K/V of [0, start): float32 logits of the
        last token [vocab], or of every token [n, vocab] (a verify). Positions past `start` (a rejected draft's)
        are dropped first."""
        if start > self.table.length:
            raise ValueError(f"position {start} is past the table's {self.table.length} positions")
        self.set_length(start)
        if self.runner is not None and self.runner.fits(len(tokens)):
            logits = self.runner.forward(tokens, self.table, all_logits)
            return (logits[None] if all_logits and logits.dim() == 1 else logits).clone()  # the runner's buffer
        logits = paged_forward(self.model, tokens, self.table, backend=self.backend,
                               logits_to_keep=len(tokens) if all_logits else 1)[0]
        return logits if all_logits else logits[-1]

    def set_length(self, length: int) -> None:
        """Keep the table's first `length` positions (a no-op when it holds no more)."""
        if length < self.table.length:
            self.table.truncate(length)


def use_table_forward(paged_attention: str, model: torch.nn.Module) -> bool:
    """Whether single requests run over block tables (EngineConfig.paged_attention; "auto" is "workspace" for
    now). "table" for a model whose attention a table cannot compute exactly is refused, never approximated."""
    if paged_attention != "table":
        return False
    from ..batch.cascade import unsupported_reason  # the same limits: plain causal attention only

    reason = unsupported_reason(model)
    if reason is not None:
        raise ValueError(f"paged_attention='table' computes plain causal attention only; this model has {reason} "
                         "(use paged_attention='workspace')")
    return True
