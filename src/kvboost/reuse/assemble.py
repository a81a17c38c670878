"""Place content matches into the workspace at their new positions: keys moved by an exact rotation per token
(reuse/rope.py), values copied. Whatever cannot be rotated exactly is refused before anything is written."""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from ..kv.workspace import KVWorkspace
from ..store.base import ChunkRecord, ChunkStore
from .content import ContentIndex, ContentSegment, Piece
from .rope import RotaryInfo, rerotate_keys, rotation_support


@dataclass
class Assembly:
    """What was placed: approximate K/V at `positions` of the workspace, in runs that each begin at a seam."""

    segments: list[ContentSegment] = field(default_factory=list)
    n_tokens: int = 0

    @property
    def seams(self) -> list[int]:
        return [s.start for s in self.segments]

    def mask(self, length: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Bool [length]: True where the workspace holds placed (approximate) K/V."""
        out = torch.zeros(length, dtype=torch.bool, device=device)
        for seg in self.segments:
            for p in seg.pieces:
                out[p.start:p.end] = True
        return out


def place_segments(workspace: KVWorkspace, store: ChunkStore, index: ContentIndex, ids: list[int],
                   segments: list[ContentSegment], infos: list[RotaryInfo], row: int | None = None
                   ) -> tuple[Assembly | None, str | None]:
    """Load each piece's record, verify its ids, re-rotate its keys and write K/V at its positions (all rows, or `row`);
    a piece whose record is gone or disagrees is left for prefill. (None, reason) when nothing could be placed."""
    records: dict[str, ChunkRecord | None] = {}
    # Layers sharing one rotation (same inv_freq and rotary_dim), so cos/sin are built once per piece.
    by_rotation: dict[tuple, tuple[RotaryInfo, list[int]]] = {}
    for i, info in enumerate(infos):
        # tolist(), not numpy(): inv_freq lives on the model's device (CUDA included).
        key = (info.rotary_dim, tuple(info.inv_freq.detach().flatten().tolist()))
        by_rotation.setdefault(key, (info, []))[1].append(i)
    groups = list(by_rotation.values())
    placed: list[ContentSegment] = []
    n_placed = 0
    for seg in segments:
        current: list[Piece] = []
        for piece in seg.pieces:
            if piece.key not in records:
                records[piece.key] = store.get(piece.key)
                if records[piece.key] is None:
                    index.discard(piece.key)
            record = records[piece.key]
            ok = record is not None and (record.token_ids[piece.offset:piece.offset + piece.n_tokens]
                                         == tuple(ids[piece.start:piece.end]))
            if not ok:
                if current:
                    placed.append(ContentSegment(current))
                current = []
                continue
            _write_piece(workspace, record, piece, groups, row)
            current.append(piece)
            n_placed += piece.n_tokens
        if current:
            placed.append(ContentSegment(current))
    return (Assembly(placed, n_placed), None) if n_placed else (None, "matched chunks are no longer stored")


def _write_piece(workspace: KVWorkspace, record: ChunkRecord, piece: Piece,
                 groups: list[tuple[RotaryInfo, list[int]]], row: int | None) -> None:
    sl = slice(piece.offset, piece.offset + piece.n_tokens)
    # Records from the disk or Redis tier live on the CPU: rotate where the workspace (and inv_freq) lives.
    values = [v[..., sl, :].to(workspace.device) for v in record.values]
    keys: list[torch.Tensor] = [k[..., sl, :].to(workspace.device) for k in record.keys]
    if piece.delta != 0:
        for info, layers in groups:
            if len({keys[i].shape for i in layers}) == 1:
                # One rotation for the whole group: stacking costs a copy, building cos/sin per layer costs more.
                moved = rerotate_keys(torch.stack([keys[i] for i in layers]), piece.delta, info,
                                      src_positions=piece.src_start)
                for j, i in enumerate(layers):
                    keys[i] = moved[j]
            else:
                for i in layers:
                    keys[i] = rerotate_keys(keys[i], piece.delta, info, src_positions=piece.src_start)
    workspace.write(keys, values, piece.start, piece.n_tokens, row=row)


class ContentState:
    """Per-engine content reuse state: the window index and the model's (cached) eligibility verdict."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.index = ContentIndex()

    @functools.cached_property
    def eligibility(self) -> tuple[list[RotaryInfo] | None, str | None]:
        """Rotary settings if both re-rotation and the layer-wise repair are exact for this model."""
        from .repair import repair_support

        infos, reason = rotation_support(self.model)
        reason = reason or repair_support(self.model)
        return (None, reason) if reason is not None else (infos, None)

    def find(self, store: ChunkStore, ids: list[int], start: int, stop: int, salt: str | None
             ) -> tuple[list[ContentSegment], list[RotaryInfo] | None, str | None]:
        """Content matches in ids[start:stop] and their rotary settings; ([], None, reason) if not placeable exactly."""
        if self.index.prune_due():
            self.index.prune(store.contains)
        segments = self.index.find(ids, start, stop, salt)
        if not segments:
            return [], None, None
        infos, reason = self.eligibility
        return (segments, infos, None) if infos is not None else ([], None, reason)
