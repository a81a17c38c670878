"""Forward pieces over a pooled, preallocated KV workspace: one buffer per layer across requests (DynamicCache
reallocates every step), written in place, remembering which ids its first positions hold."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache

from .length_layer import LengthLayer

_GROW_STEP = 256
_FEW_PIECES = 4  # up to this many pieces are copied one by one: as cheap as making them contiguous for a cat


@dataclass(frozen=True)
class LayerShape:
    kv_heads: int
    head_dim_k: int
    head_dim_v: int


def grown_capacity(needed: int, capacity: int, max_positions: int | None, base: int = 0) -> int:
    """A capacity for positions [0, needed): the allocated columns (not the positions below base, which take no memory)
    grow by half, in steps of _GROW_STEP, capped at max_positions but never below needed."""
    cols = max(needed - base, int((capacity - base) * 1.5))
    target = base + -(-cols // _GROW_STEP) * _GROW_STEP
    return max(needed, min(target, max_positions)) if max_positions else target


def concat_into(pieces: list[torch.Tensor], dst: torch.Tensor) -> None:
    """dst ([kv_heads, n, d], a strided view of a buffer) <- the pieces concatenated along tokens (any devices)."""
    many = len(pieces) > _FEW_PIECES
    if many and all(p.device == dst.device and p.dtype == dst.dtype for p in pieces):
        # cat(out=) writes the strided slice directly; CUDA's batched cat needs contiguous inputs.
        torch.cat([p.contiguous() for p in pieces], dim=-2, out=dst)
    elif many and all(p.device == pieces[0].device for p in pieces):
        # Records from a CPU tier into a device workspace: one transfer per layer instead of one per chunk.
        dst.copy_(torch.cat(pieces, dim=-2))
    else:  # a few pieces (or mixed devices): one copy each
        offset = 0
        for p in pieces:
            dst[:, offset:offset + p.shape[-2]].copy_(p)
            offset += p.shape[-2]


class InPlaceLayer(LengthLayer):
    """A full-attention cache layer that writes into the workspace buffer of its layer."""

    is_croppable = True

    def __init__(self, workspace: KVWorkspace, layer_idx: int, length: int):
        super().__init__()
        if workspace.base:
            raise ValueError("InPlaceLayer needs a workspace whose columns start at position 0")
        self.workspace = workspace
        self.layer_idx = layer_idx
        self.length = length
        self._refresh_views()

    def _refresh_views(self) -> None:
        k_buf, v_buf = self.workspace.buffers(self.layer_idx)
        self.keys = k_buf[:, :, : self.length]
        self.values = v_buf[:, :, : self.length]
        self.dtype, self.device = k_buf.dtype, k_buf.device

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        end = self.length + key_states.shape[-2]
        self.workspace.ensure_layer_capacity(self.layer_idx, end)
        k_buf, v_buf = self.workspace.buffers(self.layer_idx)
        k_buf[:, :, self.length:end].copy_(key_states)
        v_buf[:, :, self.length:end].copy_(value_states)
        self.length = end
        self._refresh_views()
        return self.keys, self.values

    def set_length(self, length: int) -> None:
        """The layer holds `length` tokens (written by someone else, e.g. a captured step over the buffers)."""
        self.workspace.ensure_layer_capacity(self.layer_idx, length)
        self.length = length
        self._refresh_views()

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove < 0:
            self.set_length(max(0, self.length + tokens_to_remove))

    def reset(self) -> None:
        self.set_length(0)


def _resident_attr(name: str) -> property:
    """A read-write property over the field `name` of the object's `resident`."""
    return property(lambda self: getattr(self.resident, name), lambda self, value: setattr(self.resident, name, value))


class KVWorkspace:
    """Per-layer K/V buffers [batch, kv_heads, columns, head_dim] reused across requests. Column c holds position
    `base + c`; `capacity`, `write`, `read` and `ensure_capacity` speak in positions, `buffers` in columns."""

    def __init__(self, shapes: list[LayerShape], dtype: torch.dtype, device: torch.device, batch_size: int = 1,
                 max_positions: int | None = None):
        self.shapes = shapes
        self.dtype = dtype
        self.device = device
        self.batch_size = batch_size
        self.max_positions = max_positions
        self._k: list[torch.Tensor] = []
        self._v: list[torch.Tensor] = []
        self.base = 0
        self.capacity = 0  # positions [0, capacity) are addressable; [base, capacity) are allocated
        # Per row: token ids whose exact K/V (under the tag) sit at its positions [0, len), reusable without a copy.
        self.residents: list[Resident] = [Resident() for _ in range(batch_size)]
        self.generation = 0  # bumped each time the buffers are reallocated
        self._allocate(0)

    @property
    def resident(self) -> Resident:
        """The first row's, as the single-sequence API calls it (the engine's primary row)."""
        return self.residents[0]

    resident_ids = _resident_attr("ids")
    resident_tag = _resident_attr("tag")

    def row(self, index: int) -> RowView:
        """Row `index` as a one-row workspace (its buffers are views of this one's)."""
        if not 0 <= index < self.batch_size:
            raise IndexError(f"row {index} of a {self.batch_size}-row workspace")
        return RowView(self, index)

    def ensure_rows(self, rows: int) -> None:
        """At least `rows` rows, every row's contents (and what each holds resident) kept."""
        if rows > self.batch_size:
            old_k, old_v, old_rows = self._k, self._v, self.batch_size
            self.batch_size = rows
            self._allocate(self.capacity, keep=0)
            for new, old in zip(self._k + self._v, old_k + old_v):
                new[:old_rows].copy_(old)
            self.residents += [Resident() for _ in range(rows - old_rows)]

    def forget_residents(self) -> None:
        for resident in self.residents:
            resident.clear()

    # ---- buffers ------------------------------------------------------------------------------
    def _allocate(self, capacity: int, keep: int = 0, base: int | None = None) -> None:
        """New buffers for positions [base, capacity), keeping the old contents of [base, keep)."""
        base = self.base if base is None else base
        capacity = max(capacity, base)
        lo = max(base, self.base)  # kept positions must exist in both layouts
        new_k, new_v = [], []
        # Zeroed: batched steps mask other rows' padding columns, and masked NaN garbage still poisons the softmax.
        for i, s in enumerate(self.shapes):
            for new, old, d in ((new_k, self._k, s.head_dim_k), (new_v, self._v, s.head_dim_v)):
                t = torch.zeros(self.batch_size, s.kv_heads, capacity - base, d, dtype=self.dtype, device=self.device)
                if keep > lo and old:
                    t[:, :, lo - base:keep - base].copy_(old[i][:, :, lo - self.base:keep - self.base])
                new.append(t)
        self._k, self._v, self.capacity, self.base = new_k, new_v, capacity, base
        # Buffers were replaced: anything holding their addresses (a captured CUDA graph) must be rebuilt.
        self.generation += 1

    def rebase(self, base: int, keep: int = 0) -> None:
        """Make column 0 hold position `base`, keeping [max(base, old base), keep); nothing stays resident."""
        if base != self.base:
            self._allocate(max(self.capacity, keep), keep=keep, base=base)
            self.forget_residents()

    def _grown(self, needed: int) -> int:
        return grown_capacity(needed, self.capacity, self.max_positions, self.base)

    def ensure_capacity(self, needed: int, keep: int = 0) -> None:
        """Room for positions [0, needed), keeping every row's columns up to `keep` and what rows hold resident."""
        if needed > self.capacity:
            resident = max((len(r.ids) for r in self.residents), default=0)
            self._allocate(self._grown(needed), keep=min(max(keep, resident), self.capacity))

    def ensure_layer_capacity(self, layer_idx: int, needed: int) -> None:
        # Growth during a forward: every layer grows together, keeping what each holds.
        if needed > self.capacity:
            self._allocate(self._grown(needed), keep=self.capacity)

    def buffers(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._k[layer_idx], self._v[layer_idx]

    def release(self) -> None:
        """Give the buffers' memory back (the next request reallocates)."""
        self._allocate(0, base=0)
        self.forget_residents()

    # ---- contents -----------------------------------------------------------------------------
    def write(self, layer_keys: list[torch.Tensor], layer_values: list[torch.Tensor], start: int,
              n_tokens: int | None = None, row: int | None = None) -> None:
        """Copy one chunk's K/V ([kv_heads, n, d] or [1, kv_heads, n, d]) to positions start... of every row, or one
        `row`, a layer at a time through write_layer (RowView and HostWorkspace share it)."""
        for i, (k, v) in enumerate(zip(layer_keys, layer_values)):
            k, v = (k[0], v[0]) if k.dim() == 4 else (k, v)
            n = k.shape[-2] if n_tokens is None else n_tokens
            self.write_layer(i, [k[:, :n]], [v[:, :n]], start, row=row)

    def write_layer(self, layer_idx: int, keys: list[torch.Tensor], values: list[torch.Tensor], start: int,
                    row: int | None = None) -> None:
        """Copy consecutive pieces of one layer's K/V ([kv_heads, n_i, d] each) to positions start... of every row, or
        one `row`, concatenated straight into the buffer: a few copies per layer, not one per chunk."""
        c = self._column(start)
        for pieces, buf in ((keys, self._k[layer_idx]), (values, self._v[layer_idx])):
            n = sum(p.shape[-2] for p in pieces)
            if n == 0:
                continue
            first = 0 if row is None else row
            concat_into(pieces, buf[first, :, c:c + n])
            if row is None and self.batch_size > 1:  # every row gets the same K/V
                buf[1:, :, c:c + n].copy_(buf[:1, :, c:c + n])

    def read(self, start: int, end: int, row: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Owned copies of positions [start, end) of one batch row: safe to store after the buffers move on."""
        lo, hi = self._column(start), end - self.base
        return [k[row, :, lo:hi].clone() for k in self._k], [v[row, :, lo:hi].clone() for v in self._v]

    def _column(self, position: int) -> int:
        if position < self.base:
            raise ValueError(f"position {position} is below this workspace's first position {self.base}")
        return position - self.base

    def make_cache(self, length: int) -> Cache:
        return Cache(layers=[InPlaceLayer(self, i, length) for i in range(len(self.shapes))])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._k + self._v)


@dataclass
class Resident:
    """What one workspace row holds at [0, len(ids)): exact K/V of `ids` under `tag` (namespace and tenant)."""

    ids: list[int] = field(default_factory=list)
    tag: str | None = None

    def clear(self) -> None:
        self.ids, self.tag = [], None


class RowView:
    """One row of a KVWorkspace with the workspace's own surface (buffers [1, kv_heads, columns, d] are views of the
    parent's row), so single-sequence code runs on any row. Growth goes to the parent."""

    batch_size = 1

    def __init__(self, parent: KVWorkspace, index: int):
        self.parent, self.index = parent, index

    # read-only, from the parent
    shapes, dtype, device, base, capacity, max_positions, generation = (
        property(lambda self, n=n: getattr(self.parent, n))
        for n in ("shapes", "dtype", "device", "base", "capacity", "max_positions", "generation"))

    @property
    def resident(self) -> Resident:
        return self.parent.residents[self.index]

    resident_ids = _resident_attr("ids")
    resident_tag = _resident_attr("tag")

    def buffers(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.parent.buffers(layer_idx)
        return k[self.index:self.index + 1], v[self.index:self.index + 1]

    def ensure_capacity(self, needed: int, keep: int = 0) -> None:
        self.parent.ensure_capacity(needed, keep=self.parent.capacity)  # other rows' columns are not ours to drop

    def ensure_layer_capacity(self, layer_idx: int, needed: int) -> None:
        self.parent.ensure_layer_capacity(layer_idx, needed)

    def write_layer(self, layer_idx: int, keys: list[torch.Tensor], values: list[torch.Tensor], start: int,
                    row: int | None = None) -> None:
        self.parent.write_layer(layer_idx, keys, values, start, row=self.index)

    def read(self, start: int, end: int, row: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return self.parent.read(start, end, row=self.index)

    make_cache = KVWorkspace.make_cache  # its layers write through this row
    write = KVWorkspace.write
