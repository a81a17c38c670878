"""Rows of the scheduler running together: one shared prefix K/V per batch, cascade attention, batched forwards,
speculation per row."""
from __future__ import annotations

from .prefix import PrefixedRows, SharedPrefix, find_common_chunk_prefix, group_by_prefix
from .rows import SequenceHandle

__all__ = ["SequenceHandle", "SharedPrefix", "PrefixedRows", "find_common_chunk_prefix", "group_by_prefix"]
