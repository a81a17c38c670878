"""Batched and continuous generation: shared prefix K/V loaded once, rows joining and leaving mid-flight.

Public helpers from the product docs (find_common_chunk_prefix, broadcast_kv, group_by_prefix) and
the BatchRunner that the server's scheduler drives one decode step at a time.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Sequence

import torch


def find_common_chunk_prefix(all_token_ids: Sequence[Sequence[int]], chunk_size: int) -> int:
    """Length of the longest chunk-aligned prefix shared by every prompt."""
    if not all_token_ids:
        return 0
    shortest = min(len(ids) for ids in all_token_ids)
    first = all_token_ids[0]
    n = 0
    while n + chunk_size <= shortest and all(list(ids[n:n + chunk_size]) == list(first[n:n + chunk_size])
                                             for ids in all_token_ids[1:]):
        n += chunk_size
    return n


def broadcast_kv(kv: Sequence[tuple[torch.Tensor, torch.Tensor]], batch_size: int
                 ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """[1, heads, seq, dim] → [batch, heads, seq, dim] views sharing storage (expand, zero-copy)."""
    out = []
    for k, v in kv:
        if k.shape[0] != 1:
            raise ValueError(f"broadcast_kv expects batch dimension 1, got {k.shape[0]}")
        out.append((k.expand(batch_size, *k.shape[1:]), v.expand(batch_size, *v.shape[1:])))
    return out


def group_by_prefix(prompts: Sequence[str], token_ids_list: Sequence[Sequence[int]], chunk_size: int,
                    n_prefix_chunks: int = 3) -> dict[tuple, list[int]]:
    """Prompt indices grouped by their first n_prefix_chunks chunks (shorter prompts by all full chunks)."""
    if len(prompts) != len(token_ids_list):
        raise ValueError("prompts and token_ids_list differ in length")
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i, ids in enumerate(token_ids_list):
        n = min(len(ids) // chunk_size, n_prefix_chunks) * chunk_size
        groups[tuple(ids[:n])].append(i)
    return dict(groups)
