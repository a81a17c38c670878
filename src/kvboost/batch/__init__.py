"""Rows of the scheduler running together: one shared prefix K/V per batch, cascade attention, batched forwards,
speculation per row.

rows.py         Row / SequenceHandle (a request in the scheduler)
forwards.py     the eager batched forwards over the workspace's slots (decode, ragged verify, prefill of one slot)
speculation.py  speculation per row: a row alone verifies its drafts, rows together in ragged steps
drafting.py     the verify width of a busy batch
prefix.py       SharedPrefix / PrefixedRows and the prefix helpers from the product docs
                (find_common_chunk_prefix, broadcast_kv, group_by_prefix)
cascade.py      shared-prefix attention registered through transformers' AttentionInterface
"""
from __future__ import annotations

from .prefix import PrefixedRows, SharedPrefix, broadcast_kv, find_common_chunk_prefix, group_by_prefix
from .rows import SequenceHandle

__all__ = ["SequenceHandle", "SharedPrefix", "PrefixedRows", "broadcast_kv", "find_common_chunk_prefix",
           "group_by_prefix"]
