"""A sequence's block table: which pool blocks hold its positions, and the holds that keep them alive.

Position p sits in slot p % block_size of blocks[p // block_size]. The table holds one reference on each of its
blocks. Blocks mapped from a stored chunk (map_shared) or kept after a fork are shared: before this sequence
writes into a shared block that is only partly filled, the block is copied (copy on write), so what another
holder reads never changes under it. New positions go into the sequence's own last block, then into new ones.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from .blocks import BlockError, BlockPool


class BlockTable:
    def __init__(self, pool: BlockPool):
        self.pool = pool
        self.blocks: list[int] = []
        self.length = 0  # positions [0, length) hold this sequence's K/V
        self.cow_copies = 0  # shared partial blocks copied before a write

    @property
    def block_size(self) -> int:
        return self.pool.layout.block_size

    def __len__(self) -> int:
        return self.length

    # ---- growing ---------------------------------------------------------------------------------
    def map_shared(self, blocks: Sequence[int], n_tokens: int, held: bool = False) -> None:
        """Append held blocks (a stored chunk's) holding the next n_tokens positions: no copy, one more hold each
        (held=True: the caller already took those holds for this table, e.g. BlockCache.acquire).

        The table must end on a block boundary; only the last mapped block may be partly filled."""
        bs = self.block_size
        if self.length % bs:
            raise BlockError(f"cannot map blocks after position {self.length}: not on a {bs}-token block boundary")
        if not blocks or not (len(blocks) - 1) * bs < n_tokens <= len(blocks) * bs:
            raise BlockError(f"{len(blocks)} blocks cannot hold exactly {n_tokens} tokens of {bs} per block")
        if not held:
            self.pool.incref(blocks)
        self.blocks.extend(blocks)
        self.length += n_tokens

    def reserve(self, n: int) -> torch.Tensor:
        """Make positions [length, length + n) writable by this sequence alone and take them; returns their
        flat slots [n] (block * block_size + offset). All or nothing: on OutOfBlocksError the table is unchanged."""
        if n < 0:
            raise BlockError(f"cannot reserve {n} positions")
        bs = self.block_size
        start, end = self.length, self.length + n
        partial = start % bs != 0 and n > 0
        cow = partial and self.pool.refcount(self.blocks[-1]) > 1
        extra = self.pool.layout.blocks_for(end) - len(self.blocks)
        fresh = self.pool.allocate(extra + int(cow))
        if cow:
            copy, fresh = fresh[0], fresh[1:]
            shared = self.blocks[-1]
            self.pool.copy_block(shared, copy)
            self.blocks[-1] = copy
            self.pool.decref(shared)
            self.cow_copies += 1
        self.blocks.extend(fresh)
        self.length = end
        return self.slots(start, end)

    def slots(self, start: int, end: int) -> torch.Tensor:
        """Flat slots [end - start] of positions [start, end) (int64, on the pool's device)."""
        if not 0 <= start <= end <= self.length:
            raise BlockError(f"positions [{start}, {end}) outside the table's {self.length}")
        bs = self.block_size
        pos = torch.arange(start, end)
        ids = torch.tensor(self.blocks, dtype=torch.long) if self.blocks else torch.zeros(0, dtype=torch.long)
        return (ids[pos // bs] * bs + pos % bs).to(self.pool.device)

    def write(self, layer: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """keys/values [kv_heads, n, d] of one layer at positions [start, start + n), already reserved. Refuses a
        block another holder shares (those positions were mapped, not reserved)."""
        n = keys.shape[-2]
        bs = self.block_size
        touched = self.blocks[start // bs: self.pool.layout.blocks_for(start + n)] if n else []
        shared = [b for b in touched if self.pool.refcount(b) > 1]
        if shared:
            raise BlockError(f"blocks {shared} are shared: writing positions [{start}, {start + n}) would change "
                             "what another holder reads")
        self.pool.write_runs(layer, self.runs(start, start + n), keys, values)

    def runs(self, start: int, end: int) -> list[tuple[int, int, int, int]]:
        """Positions [start, end) as (block, offset in block, offset from start, n) runs, one per block touched."""
        if not 0 <= start <= end <= self.length:
            raise BlockError(f"positions [{start}, {end}) outside the table's {self.length}")
        bs, out, pos = self.block_size, [], start
        while pos < end:
            off = pos % bs
            n = min(bs - off, end - pos)
            out.append((self.blocks[pos // bs], off, pos - start, n))
            pos += n
        return out

    # ---- sharing and shrinking -------------------------------------------------------------------
    def fork(self) -> BlockTable:
        """A second table over the same blocks (e.g. n samples of one prompt); either copies on its next write
        into a shared partial block."""
        other = BlockTable(self.pool)
        self.pool.incref(self.blocks)
        other.blocks, other.length = list(self.blocks), self.length
        return other

    def truncate(self, length: int) -> None:
        """Keep positions [0, length) (a speculative rollback); blocks past them are released."""
        if not 0 <= length <= self.length:
            raise BlockError(f"cannot truncate {self.length} positions to {length}")
        keep = self.pool.layout.blocks_for(length)
        dropped, self.blocks = self.blocks[keep:], self.blocks[:keep]
        self.length = length
        if dropped:
            self.pool.decref(dropped)

    def release(self) -> None:
        """Release every hold (the sequence finished); the table is empty afterwards."""
        self.truncate(0)

    # ---- for attention ---------------------------------------------------------------------------
    def ids(self, width: int | None = None) -> torch.Tensor:
        """Block ids [width] int32 (default: this table's block count), padded with 0: padded entries lie past the
        row's length and are never read."""
        width = len(self.blocks) if width is None else width
        if width < len(self.blocks):
            raise BlockError(f"width {width} < the table's {len(self.blocks)} blocks")
        return torch.tensor(self.blocks + [0] * (width - len(self.blocks)), dtype=torch.int32)


def stack_tables(tables: Sequence[BlockTable], device: torch.device | str,
                 width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(block ids [B, width] int32, lengths [B] int32) of a batch of tables, on `device`."""
    width = max((len(t.blocks) for t in tables), default=0) if width is None else width
    ids = torch.stack([t.ids(width) for t in tables]) if tables else torch.zeros(0, width, dtype=torch.int32)
    lengths = torch.tensor([t.length for t in tables], dtype=torch.int32)
    return ids.to(device), lengths.to(device)
