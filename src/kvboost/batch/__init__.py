"""Batched generation: continuous batching (BatchRunner), one shared prefix K/V per batch, cascade attention.

runner.py   BatchRunner: rows join at any step, leave when done; decode steps run batched
rows.py     Row / SequenceHandle (a request in the runner) and runs_apart (requests that cannot be rows)
prefix.py   SharedPrefix / PrefixedRows and the prefix helpers from the product docs
            (find_common_chunk_prefix, broadcast_kv, group_by_prefix)
cascade.py  shared-prefix attention registered through transformers' AttentionInterface
"""
from __future__ import annotations

from .prefix import PrefixedRows, SharedPrefix, broadcast_kv, find_common_chunk_prefix, group_by_prefix
from .rows import RunsApart, SequenceHandle, runs_apart
from .runner import BatchRunner

__all__ = ["BatchRunner", "RunsApart", "SequenceHandle", "runs_apart", "SharedPrefix", "PrefixedRows", "broadcast_kv",
           "find_common_chunk_prefix", "group_by_prefix"]
