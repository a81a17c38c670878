"""The block pool: every layer's K/V of a sequence lives in fixed-size blocks of one tensor per device.

    storage [num_blocks, layers, 2, kv_heads, block_size, head_dim]   (2: K, then V)

`storage[i]` is one contiguous region holding all layers' K and V for block i's tokens, so moving a block (copy on
write, host offload, a disk record) is one copy, and a stored chunk is a handful of block ids rather than
2 x layers tensors. For attention a layer's keys are the strided view `storage[:, layer, 0]` ([N, H, bs, d]): a
block table ([B, blocks] ids) says which of its blocks hold a row's positions, in order.

Reference counts say who holds a block: each sequence whose block table lists it, and the block cache
(block_cache.py) for a stored chunk. A block returns to the free list only when its count reaches 0, so a block a
running sequence still reads can never be freed or handed out again, whatever the cache evicts. When the free
list runs short, the pool asks its evictor (the block cache, under the memory tier's LFU-with-aging policy) to
drop unpinned cached blocks before it gives up with OutOfBlocksError.
"""
from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from ..errors import KVBoostError
from .pinned import pinned_empty
from .workspace import LayerShape


class BlockError(KVBoostError):
    """A block pool or block table was misused."""


class OutOfBlocksError(BlockError, MemoryError):
    """No free block is left and nothing unpinned could be evicted."""


class DoubleFreeError(BlockError, RuntimeError):
    """A block was released more times than it was held."""


class FreeBlockError(BlockError, RuntimeError):
    """A block that nobody holds (on the free list) was used: shared, read or written."""


class BlockLayoutError(BlockError, ValueError):
    """The model's layers cannot share one block layout (their K/V shapes differ), or a size is wrong."""


@dataclass(frozen=True)
class BlockLayout:
    """What one block holds: `block_size` tokens of K and V for every layer."""

    layers: int
    kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if min(self.layers, self.kv_heads, self.head_dim, self.block_size) <= 0:
            raise BlockLayoutError(f"every block dimension must be positive: {self}")

    @classmethod
    def for_layers(cls, shapes: Sequence[LayerShape], block_size: int, dtype: torch.dtype) -> BlockLayout:
        """The layout of a model whose layers all have the same kv heads and head dim (K and V alike)."""
        kinds = {(s.kv_heads, s.head_dim_k, s.head_dim_v) for s in shapes}
        if len(kinds) != 1:
            raise BlockLayoutError(f"layers differ in (kv_heads, head_dim_k, head_dim_v): {sorted(kinds)}; "
                                   "one block layout needs them equal")
        heads, dk, dv = kinds.pop()
        if dk != dv:
            raise BlockLayoutError(f"key head dim {dk} != value head dim {dv}")
        return cls(len(shapes), heads, dk, block_size, dtype)

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        return (self.layers, 2, self.kv_heads, self.block_size, self.head_dim)

    @cached_property  # read on every budget check: torch's element size is not free
    def block_nbytes(self) -> int:
        n = 1
        for s in self.block_shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)


class BlockPool:
    """Blocks of one device with reference counts; thread-safe.

    allocate -> a block held once (count 1); incref shares it (a fork, the cache keeping a stored chunk); decref
    releases one hold and frees the block at 0. Errors: OutOfBlocksError (allocation), DoubleFreeError (a release
    below 0), FreeBlockError (sharing or addressing a free block).
    """

    def __init__(self, layout: BlockLayout, num_blocks: int, device: torch.device | str = "cpu",
                 pin_memory: bool = False):
        if num_blocks <= 0:
            raise BlockLayoutError(f"num_blocks must be positive, not {num_blocks}")
        self.layout = layout
        self.device = torch.device(device)
        # Empty (a large pool commits memory only as blocks are first written); allocate() zeroes what it hands
        # out: attention over a block's unwritten tail is masked, but masked NaN garbage would still poison a
        # softmax (0 * NaN = NaN) in a gather-then-mask path.
        # pin_memory: page-locked at its exact size (pinned.py: torch's own pinning would lock the next power of
        # two), or pageable where that cannot be had (`unpinned_reason` says why).
        self.unpinned_reason: str | None = None
        if pin_memory and self.device.type == "cpu":
            self.storage, self.unpinned_reason = pinned_empty((num_blocks, *layout.block_shape), layout.dtype)
        else:
            if pin_memory:
                self.unpinned_reason = f"a {self.device.type} pool is not host memory"
            self.storage = torch.empty(num_blocks, *layout.block_shape, dtype=layout.dtype, device=self.device)
        self.pinned = pin_memory and self.unpinned_reason is None
        self._refs = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._lock = threading.Lock()
        self._evictor: Callable[[int], int] | None = None
        self.allocations = 0
        self.evict_requests = 0

    # ---- counts ----------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self._refs)

    @property
    def num_free(self) -> int:
        with self._lock:
            return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def nbytes(self) -> int:
        return self.storage.numel() * self.storage.element_size()

    def refcount(self, block: int) -> int:
        self._check_id(block)
        with self._lock:
            return self._refs[block]

    def refcounts(self, blocks: Sequence[int]) -> list[int]:
        """Each block's count, read under one lock."""
        for b in blocks:
            self._check_id(b)
        with self._lock:
            return [self._refs[b] for b in blocks]

    def set_evictor(self, evictor: Callable[[int], int] | None) -> None:
        """`evictor(n)` is asked to release at least n blocks (it may release fewer: pinned ones stay); it must
        release them through decref. Called without the pool's lock held, so it may take its own."""
        self._evictor = evictor

    # ---- holding ---------------------------------------------------------------------------------
    def allocate(self, n: int = 1, zero: bool = True) -> list[int]:
        """n free blocks, each held once. All or nothing: on OutOfBlocksError nothing is held. zero=False: the
        caller overwrites every position at once (a whole-block copy), so the fill is skipped - on a host pool
        that matters beyond speed: the fill would run on the host at once, ahead of copies still queued on the
        device's stream that read the block's previous contents."""
        if n < 0:
            raise BlockError(f"cannot allocate {n} blocks")
        got = self._take(n)
        if got is None and self._evictor is not None:
            with self._lock:
                short = n - len(self._free)
            self.evict_requests += 1
            self._evictor(short)  # outside the lock: the evictor releases through decref
            got = self._take(n)
        if got is None:
            raise OutOfBlocksError(f"{n} blocks wanted, {self.num_free} free of {self.num_blocks} "
                                   "(the rest are held by running sequences or pinned stored chunks)")
        for b in got if zero else ():  # a plain fill per block: an indexed assignment is several times slower on CPU
            self.storage[b].zero_()
        return got

    def _take(self, n: int) -> list[int] | None:
        with self._lock:
            if len(self._free) < n:
                return None
            got = [self._free.popleft() for _ in range(n)]
            for b in got:
                self._refs[b] = 1
            self.allocations += n
            return got

    def incref(self, blocks: int | Sequence[int]) -> None:
        """One more hold on each block (it must be held already: a free block cannot be revived)."""
        ids = [blocks] if isinstance(blocks, int) else list(blocks)
        for b in ids:
            self._check_id(b)
        with self._lock:
            dead = [b for b in ids if self._refs[b] == 0]
            if dead:
                raise FreeBlockError(f"blocks {dead} are free; only a held block can be shared")
            for b in ids:
                self._refs[b] += 1

    def decref(self, blocks: int | Sequence[int]) -> list[int]:
        """Release one hold on each block; returns the blocks that became free. Checked before any change."""
        ids = [blocks] if isinstance(blocks, int) else list(blocks)
        for b in ids:
            self._check_id(b)
        with self._lock:
            want: dict[int, int] = {}
            for b in ids:
                want[b] = want.get(b, 0) + 1
            over = [b for b, k in want.items() if self._refs[b] < k]
            if over:
                raise DoubleFreeError(f"blocks {over} released more often than held")
            freed = []
            for b in ids:
                self._refs[b] -= 1
                if self._refs[b] == 0:
                    self._free.append(b)
                    freed.append(b)
            return freed

    # ---- contents --------------------------------------------------------------------------------
    def keys(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s keys of every block: a view [num_blocks, kv_heads, block_size, head_dim]."""
        return self.storage[:, layer, 0]

    def values(self, layer: int) -> torch.Tensor:
        return self.storage[:, layer, 1]

    def copy_block(self, src: int, dst: int) -> None:
        """Block dst <- block src, every layer's K and V: one copy."""
        self._check_held(src, dst)
        self.storage[dst].copy_(self.storage[src])

    def write(self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write keys/values [kv_heads, n, d] of one layer to flat slots [n] (block * block_size + offset).

        The caller (a block table) owns the slots' blocks; shared blocks are copied on write before this."""
        bs = self.layout.block_size
        blk, off = slots // bs, slots % bs
        # Advanced indices split by a slice put their dim first: the target is [n, kv_heads, d].
        self.keys(layer)[blk, :, off] = keys.transpose(0, 1).to(self.storage.dtype)
        self.values(layer)[blk, :, off] = values.transpose(0, 1).to(self.storage.dtype)

    def copy_from(self, other: BlockPool, src: int, dst: int) -> None:
        """Block dst of this pool <- block src of `other` (same layout; host <-> device): one copy, enqueued on the
        current stream (asynchronous between pinned host memory and a GPU)."""
        if other.layout != self.layout:
            raise BlockLayoutError(f"cannot copy a block of layout {other.layout} into {self.layout}")
        other._check_held(src)
        self._check_held(dst)
        self.storage[dst].copy_(other.storage[src], non_blocking=True)

    def write_packed(self, block: int, offset: int, packed: torch.Tensor) -> None:
        """Positions [offset, offset + n) of block `block`, every layer's K and V, <- packed
        [layers, 2, kv_heads, n, head_dim] (a stored record's layout): one copy."""
        self._check_held(block)
        n = packed.shape[3] if packed.dim() == 5 else -1
        if packed.dim() != 5 or tuple(packed.shape[:3]) != self.layout.block_shape[:3] \
                or packed.shape[4] != self.layout.head_dim or not 0 <= offset <= offset + n <= self.layout.block_size:
            raise BlockLayoutError(f"packed K/V {tuple(packed.shape)} at offset {offset} does not fit a block "
                                   f"{self.layout.block_shape}")
        self.storage[block, :, :, :, offset:offset + n].copy_(packed)

    def read_packed(self, blocks: Sequence[int], n_tokens: int) -> torch.Tensor:
        """The first n_tokens positions of `blocks` (in order) as a new tensor [layers, 2, kv_heads, n_tokens,
        head_dim]: one copy per block."""
        self._check_held(*blocks)
        bs = self.layout.block_size
        if not 0 <= n_tokens <= len(blocks) * bs:
            raise BlockLayoutError(f"{n_tokens} tokens do not fit {len(blocks)} blocks of {bs}")
        out = torch.empty(*self.layout.block_shape[:3], n_tokens, self.layout.head_dim, dtype=self.layout.dtype,
                          device=self.device)
        for j, b in enumerate(blocks[:self.layout.blocks_for(n_tokens)]):
            m = min(bs, n_tokens - j * bs)
            out[:, :, :, j * bs:j * bs + m].copy_(self.storage[b, :, :, :, :m])
        return out

    def write_runs(self, layer: int, runs: Sequence[tuple[int, int, int, int]], keys: torch.Tensor,
                   values: torch.Tensor) -> None:
        """Like write(), with the slots given as runs (block, offset in block, offset in keys, n): one slice copy
        per run and tensor. What a block table uses on the host; write() (slots as a device tensor, one indexed
        store per tensor) is the form a captured step can use."""
        k_dst, v_dst = self.keys(layer), self.values(layer)
        for block, off, src, n in runs:
            k_dst[block, :, off:off + n].copy_(keys[:, src:src + n])
            v_dst[block, :, off:off + n].copy_(values[:, src:src + n])

    def gather(self, layer: int, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous K, V [B, kv_heads, blocks * block_size, d] of block tables [B, blocks] (the torch path)."""
        b, nb = tables.shape
        shape = (b, self.layout.kv_heads, nb * self.layout.block_size, self.layout.head_dim)
        idx = tables.to(device=self.device, dtype=torch.long)
        if self.device.type == "cpu" and nb > 0:  # each block's view concatenated into place: one copy, not two
            out = []
            for cache in (self.keys(layer), self.values(layer)):
                dst = cache.new_empty(shape)
                with torch.no_grad():
                    for row, blocks in enumerate(idx.tolist()):
                        torch.cat([cache[i] for i in blocks], dim=1, out=dst[row])
                out.append(dst)
            return out[0], out[1]
        k = self.keys(layer)[idx].permute(0, 2, 1, 3, 4).reshape(shape)  # [B, nb, H, bs, d] -> [B, H, nb*bs, d]
        v = self.values(layer)[idx].permute(0, 2, 1, 3, 4).reshape(shape)
        return k, v

    # ---- checks ----------------------------------------------------------------------------------
    def _check_id(self, block: int) -> None:
        if not 0 <= block < len(self._refs):
            raise BlockError(f"block {block} outside the pool's {len(self._refs)} blocks")

    def _check_held(self, *blocks: int) -> None:
        for b in blocks:
            self._check_id(b)
        with self._lock:
            dead = [b for b in blocks if self._refs[b] == 0]
        if dead:
            raise FreeBlockError(f"blocks {dead} are free: nothing may read or write them")
