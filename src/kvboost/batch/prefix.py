"""Batch helpers: common chunk prefix, grouping by prefix, one shared prefix K/V."""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from ..chunking import Chunker
    from ..kv.workspace import KVWorkspace
    from ..reuse.match import Segment


def find_common_chunk_prefix(all_token_ids: Sequence[Sequence[int]], chunk_size: int,
                             chunker: Chunker | None = None) -> int:
    """Length of the longest chunk-aligned prefix shared by every prompt. With a boundary window: the furthest of the
    first prompt's complete cuts up to which every prompt has the same tokens and the same complete cuts."""
    if not all_token_ids:
        return 0
    if chunker is not None and chunker.boundary_window:
        return _common_variable_prefix(all_token_ids, chunker)
    shortest = min(len(ids) for ids in all_token_ids)
    first = all_token_ids[0]
    n = 0
    while n + chunk_size <= shortest and all(list(ids[n:n + chunk_size]) == list(first[n:n + chunk_size])
                                             for ids in all_token_ids[1:]):
        n += chunk_size
    return n


def _common_variable_prefix(all_token_ids: Sequence[Sequence[int]], chunker: Chunker) -> int:
    first = np.asarray(all_token_ids[0], dtype=np.int64)
    same = len(first)  # tokens every prompt shares with the first
    for ids in all_token_ids[1:]:
        other = np.asarray(ids[:same], dtype=np.int64)
        m = min(same, len(other))
        diff = np.flatnonzero(first[:m] != other[:m])
        same = int(diff[0]) if len(diff) else m
    if same == 0:
        return 0
    # Each prompt's complete cuts up to `same`; the answer is the last cut of the longest run they agree on.
    cuts = [[stop for _, stop, complete in chunker.spans(ids, end=same) if complete] for ids in all_token_ids]
    n = 0
    for k, stop in enumerate(cuts[0]):
        if any(len(c) <= k or c[k] != stop for c in cuts[1:]):
            break
        n = stop
    return n


def group_by_prefix(prompts: Sequence[str], token_ids_list: Sequence[Sequence[int]], chunk_size: int,
                    n_prefix_chunks: int = 3, chunker: Chunker | None = None) -> dict[tuple, list[int]]:
    """Prompt indices grouped by their first n_prefix_chunks chunks (the chunker's complete ones)."""
    if len(prompts) != len(token_ids_list):
        raise ValueError("prompts and token_ids_list differ in length")
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i, ids in enumerate(token_ids_list):
        if chunker is not None and chunker.boundary_window:
            complete = [stop for _, stop, done in chunker.spans(ids) if done]
            n = complete[min(len(complete), n_prefix_chunks) - 1] if complete and n_prefix_chunks > 0 else 0
        else:
            n = min(len(ids) // chunk_size, n_prefix_chunks) * chunk_size
        groups[tuple(ids[:n])].append(i)
    return dict(groups)


@dataclass(repr=False)
class SharedPrefix:
    """K/V of a batch's common first `length` tokens: one [1, kv_heads, length, d] per layer, tenant `salt`."""

    ids: tuple[int, ...]
    salt: str | None
    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    def __repr__(self) -> str:
        return f"SharedPrefix(length={self.length}, salt={self.salt!r}, layers={len(self.keys)})"

    @property
    def length(self) -> int:
        return len(self.ids)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    @classmethod
    def from_segments(cls, ids: Sequence[int], salt: str | None, segments: Sequence[Segment],
                      device: torch.device | str | None = None) -> SharedPrefix:
        """Concatenate stored records covering [0, len(ids)) into one tensor per layer on `device`."""
        n = len(ids)
        parts = [(seg, min(seg.n_tokens, n - seg.start)) for seg in segments if seg.start < n]
        ends = [0] + [seg.start + k for seg, k in parts]
        if not parts or any(seg.start != end for (seg, _), end in zip(parts, ends)) or ends[-1] != n:
            raise ValueError(f"segments do not cover positions [0, {n}) contiguously")
        n_layers = len(parts[0][0].record.keys)
        device = device if device is not None else parts[0][0].record.keys[0].device
        keys = [torch.cat([seg.record.keys[i][:, :k].to(device) for seg, k in parts], dim=1).unsqueeze(0)
                for i in range(n_layers)]
        values = [torch.cat([seg.record.values[i][:, :k].to(device) for seg, k in parts], dim=1).unsqueeze(0)
                  for i in range(n_layers)]
        return cls(tuple(ids), salt, keys, values)

    @classmethod
    def viewing(cls, ids: Sequence[int], salt: str | None, keys: Sequence[torch.Tensor],
                values: Sequence[torch.Tensor]) -> SharedPrefix:
        """The first len(ids) positions of per-layer K/V [kv_heads, >= len(ids), d], as views of it (no copy)."""
        n = len(ids)
        return cls(tuple(ids), salt, [k[None, :, :n] for k in keys], [v[None, :, :n] for v in values])

    def truncated(self, n: int) -> SharedPrefix | None:
        """The first n tokens as views of the same storage (None for n == 0)."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot truncate a {self.length}-token prefix to {n}")
        if n == 0:
            return None
        return SharedPrefix(self.ids[:n], self.salt, [k[:, :, :n] for k in self.keys],
                            [v[:, :, :n] for v in self.values])


class PrefixedRows:
    """A batch row's K/V read as if contiguous (prefix, then slot), as KVWorkspace.read, for write-back."""

    def __init__(self, ws: KVWorkspace, prefix: SharedPrefix | None):
        self.ws, self.prefix = ws, prefix

    def read(self, start: int, end: int, row: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        prefix = self.prefix
        if prefix is None or start >= prefix.length:
            return self.ws.read(start, end, row=row)
        p = prefix.length
        if end <= p:
            return ([k[0, :, start:end].clone() for k in prefix.keys],
                    [v[0, :, start:end].clone() for v in prefix.values])
        own_k, own_v = self.ws.read(p, end, row=row)  # the workspace's columns start at the prefix's end
        keys = [torch.cat([pk[0, :, start:], k], dim=1) for pk, k in zip(prefix.keys, own_k)]
        values = [torch.cat([pv[0, :, start:], v], dim=1) for pv, v in zip(prefix.values, own_v)]
        return keys, values
