"""KIVI-style asymmetric K/V quantization (int8 / int4) for the memory tier and the wire format: K per channel
(outliers live in fixed channels), V per token, fp16 scale and minimum per group."""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from .base import ChunkMeta, ChunkRecord

_FP16_MAX = 65504.0
_FP16_TINY = 2.0**-24  # smallest positive fp16 (subnormal): the floor for a scale

DEFAULT_GROUP_SIZE = 128
KV_CACHE_BITS = (16, 8, 4)  # kv_cache_bits: full precision, or quantized records (KIVI)


@dataclass
class QuantTensor:
    """A tensor quantized in groups along `axis`. data: uint8 codes of the axis-moved-last view (int4: two per byte, low
    nibble first); scale/zero: fp16 [*other_dims, n_groups]; x ~= code * scale + zero."""

    data: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    bits: int
    shape: tuple[int, ...]
    axis: int
    group_size: int
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.data, self.scale, self.zero))


def _round_toward(x16: torch.Tensor, exact: torch.Tensor, up: bool) -> torch.Tensor:
    """fp16 rounding that never lands on the wrong side of `exact`, so every value stays inside the grid."""
    wrong = x16.float() < exact if up else x16.float() > exact
    target = torch.full_like(x16, float("inf") if up else float("-inf"))
    try:
        nudged = torch.nextafter(x16, target)
    except (RuntimeError, NotImplementedError):
        # fp16 nextafter exists on CUDA only from torch 2.6 (and not on every backend): the CPU kernel has it.
        nudged = torch.nextafter(x16.cpu(), target.cpu()).to(x16.device)
    return torch.where(wrong, nudged, x16)


def quantizable(x: torch.Tensor) -> bool:
    """fp16 scales cannot describe non-finite values or magnitudes past fp16 range: those stay raw."""
    if not x.is_floating_point() or x.numel() == 0:
        return False
    return bool(torch.isfinite(x).all()) and float(x.abs().max()) <= _FP16_MAX / 4


def quantize_tensor(x: torch.Tensor, bits: int, group_size: int = DEFAULT_GROUP_SIZE, axis: int = -1) -> QuantTensor:
    """Quantize `x` in groups of `group_size` consecutive elements along `axis` (the last may be short). Error: |x -
    dequantize(q)| <= scale / 2 per element, scale = (max - min) / (2**bits - 1) rounded up."""
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if not quantizable(x):
        raise ValueError("tensor is empty, not floating point, non-finite or outside fp16 range")
    axis = axis % x.dim()
    qmax = (1 << bits) - 1
    moved = x.detach().movedim(axis, -1).float().contiguous()  # strided reductions are much slower on CPU
    length = moved.shape[-1]
    g = min(group_size, length)
    n_groups = -(-length // g)
    pad = n_groups * g - length
    # Replicating the last element keeps a short group's min/max those of its real elements.
    padded = torch.cat([moved, moved[..., -1:].expand(*moved.shape[:-1], pad)], -1) if pad else moved
    groups = padded.reshape(*moved.shape[:-1], n_groups, g)
    mn, mx = groups.amin(-1), groups.amax(-1)
    zero16 = _round_toward(mn.half(), mn, up=False)
    scale_exact = ((mx - zero16.float()) / qmax).clamp_min(_FP16_TINY)
    scale16 = _round_toward(scale_exact.half(), scale_exact, up=True)
    scale, zero = scale16.float().unsqueeze(-1), zero16.float().unsqueeze(-1)
    codes = torch.round((groups - zero) / scale).clamp_(0, qmax).to(torch.uint8)
    codes = codes.reshape(*moved.shape[:-1], n_groups * g)[..., :length].reshape(-1)
    data = pack_int4(codes) if bits == 4 else codes.contiguous()
    return QuantTensor(data, scale16.contiguous(), zero16.contiguous(), bits, tuple(x.shape), axis, g, x.dtype)


def dequantize_tensor(q: QuantTensor) -> torch.Tensor:
    length = q.shape[q.axis]
    moved_shape = [d for i, d in enumerate(q.shape) if i != q.axis] + [length]
    codes = unpack_int4(q.data, math.prod(moved_shape)) if q.bits == 4 else q.data
    codes = codes.reshape(moved_shape).float()
    n_groups = q.scale.shape[-1]
    pad = n_groups * q.group_size - length
    if pad:
        codes = torch.cat([codes, codes.new_zeros(*moved_shape[:-1], pad)], -1)
    groups = codes.reshape(*moved_shape[:-1], n_groups, q.group_size)
    x = groups * q.scale.float().unsqueeze(-1) + q.zero.float().unsqueeze(-1)
    x = x.reshape(*moved_shape[:-1], n_groups * q.group_size)[..., :length]
    return x.movedim(-1, q.axis).to(q.dtype).contiguous()


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes per byte, low nibble first; an odd count gets one zero nibble of padding."""
    flat = codes.reshape(-1).to(torch.uint8)
    if flat.numel() % 2:
        flat = torch.cat([flat, flat.new_zeros(1)])
    return (flat[0::2] | (flat[1::2] << 4)).contiguous()


def unpack_int4(packed: torch.Tensor, numel: int) -> torch.Tensor:
    return torch.stack([packed & 0x0F, packed >> 4], -1).reshape(-1)[:numel]


# ---- record level --------------------------------------------------------------------------------
Encoded = QuantTensor | torch.Tensor  # raw tensor where quantizing is impossible (see quantizable)


@dataclass
class QuantRecord:
    """A ChunkRecord with K/V replaced by their quantized forms; what the memory tier holds."""

    meta: ChunkMeta
    keys: list[Encoded]
    values: list[Encoded]
    bits: int

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (*self.keys, *self.values))


class QuantCodec:
    """MemoryStore Codec: encode(record) -> QuantRecord, decode -> ChunkRecord in the original dtype."""

    def __init__(self, bits: int, group_size: int = DEFAULT_GROUP_SIZE, v_group_size: int | None = None):
        if bits not in (4, 8):
            raise ValueError(f"QuantCodec bits must be 4 or 8, got {bits}")
        self.bits = bits
        self.group_size = group_size  # K: tokens per group
        self.v_group_size = v_group_size or group_size  # V: channels of a token's [heads*head_dim] per group

    def encode_value(self, v: torch.Tensor) -> Encoded:
        # [heads, tokens, head_dim] -> [tokens, heads*head_dim]: group along each token's channels.
        if not quantizable(v) or v.dim() != 3:
            return v.detach()
        flat = v.detach().permute(1, 0, 2).reshape(v.shape[1], -1)
        return quantize_tensor(flat, self.bits, self.v_group_size, axis=1)

    def encode(self, record: ChunkRecord) -> QuantRecord:
        if isinstance(record, LazyQuantRecord) and record.payload.bits == self.bits:
            # Already quantized alike (back from the host tier or the write queue): re-quantizing would add error.
            return record.payload
        # K [heads, tokens, head_dim]: grouped along tokens, separately for each (head, channel).
        keys = [quantize_tensor(k, self.bits, self.group_size, axis=1) if quantizable(k) else k.detach()
                for k in record.keys]
        return QuantRecord(record.meta(), keys, [self.encode_value(v) for v in record.values], self.bits)

    def decode(self, payload: QuantRecord) -> ChunkRecord:
        # Lazy: a lookup reads only ids and start, and place() dequantizes many chunks together (QuantRun).
        return LazyQuantRecord(payload)


def decode_key(k: Encoded) -> torch.Tensor:
    return dequantize_tensor(k) if isinstance(k, QuantTensor) else k


def decode_value(v: Encoded, heads: int) -> torch.Tensor:
    """V of `heads` K/V heads ([heads, tokens, head_dim]) from its encoding (see _heads)."""
    if not isinstance(v, QuantTensor):
        return v
    flat = dequantize_tensor(v)  # [tokens, heads*head_dim]
    return flat.reshape(flat.shape[0], heads, -1).permute(1, 0, 2).contiguous()


def decode_record(payload: QuantRecord) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every layer's K and V of one chunk, dequantized to the original dtype ([heads, tokens, head_dim])."""
    keys = payload.keys
    return [decode_key(k) for k in keys], [decode_value(v, _heads(k)) for v, k in zip(payload.values, keys)]


class LazyQuantRecord(ChunkRecord):
    """A ChunkRecord over a QuantRecord, dequantized on first access to keys/values: a lookup reads only ids and start,
    and place() dequantizes many chunks together (QuantRun)."""

    def __init__(self, payload: QuantRecord):  # not the dataclass __init__: keys/values are computed
        m = payload.meta
        self.key, self.parent_key, self.content_key = m.key, m.parent_key, m.content_key
        self.token_ids, self.start = m.token_ids, m.start
        self.payload = payload
        self._decoded: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None

    def _kv(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        if self._decoded is None:  # two threads racing here both compute the same tensors: harmless
            self._decoded = decode_record(self.payload)
        return self._decoded

    @property
    def keys(self) -> list[torch.Tensor]:  # type: ignore[override]
        return self._kv()[0]

    @property
    def values(self) -> list[torch.Tensor]:  # type: ignore[override]
        return self._kv()[1]

    @property
    def nbytes(self) -> int:
        """The dequantized size (what ChunkRecord.nbytes would say), without dequantizing."""
        return sum(math.prod(t.shape) * t.dtype.itemsize for t in (*self.payload.keys, *self.payload.values))


# ---- many chunks at once -------------------------------------------------------------------------
class QuantRun:
    """One layer of many consecutive chunks' K/V dequantized together, bit-identical to decode_key / decode_value;
    chunks that cannot join a batch (raw tensors, odd int4 rows) are decoded alone."""

    def __init__(self, payloads: Sequence[QuantRecord]):
        self.payloads = list(payloads)
        self._group_index: dict[tuple, torch.Tensor] = {}  # K token -> group, shared by every layer alike

    def layer(self, i: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Layer i's K and V of every chunk in order, as pieces [heads, tokens, head_dim]."""
        layer_keys = [p.keys[i] for p in self.payloads]
        cap = _batch_tokens(layer_keys[0])
        keys = [k for run in _runs(layer_keys, _key_batch_kind, lambda k: k.shape[1], cap) for k in self._keys(run)]
        layer_values = list(zip([p.values[i] for p in self.payloads], [_heads(k) for k in layer_keys]))
        value_runs = _runs(layer_values, _value_batch_kind, lambda item: item[0].shape[0], cap)
        return keys, [v for run in value_runs for v in _values(run)]

    def _keys(self, run: list[Encoded]) -> list[torch.Tensor]:
        if _key_batch_kind(run[0]) is None or len(run) == 1:
            return [decode_key(k) for k in run]
        qs: list[QuantTensor] = run  # type: ignore[assignment]
        heads, _, head_dim = qs[0].shape
        rows = heads * head_dim
        # K codes are [heads, head_dim, tokens]: chunks concatenate along the last axis (even int4 rows).
        if qs[0].bits == 8:
            codes = torch.cat([q.data.reshape(rows, q.shape[1]) for q in qs], dim=1)
        else:
            packed = torch.cat([q.data.reshape(rows, q.shape[1] // 2) for q in qs], dim=1)
            codes = unpack_int4(packed, packed.numel() * 2).reshape(rows, -1)
        index = self._index(qs, codes.device)
        scale = torch.cat([q.scale.reshape(rows, -1) for q in qs], dim=1).float().index_select(1, index)
        zero = torch.cat([q.zero.reshape(rows, -1) for q in qs], dim=1).float().index_select(1, index)
        x = codes.float() * scale + zero
        return [x.reshape(heads, head_dim, -1).transpose(1, 2).to(qs[0].dtype)]

    def _index(self, qs: list[QuantTensor], device: torch.device) -> torch.Tensor:
        """For each token of the concatenated chunks, the column of its group in the concatenated scales."""
        layout = tuple((q.shape[1], q.group_size) for q in qs)
        index = self._group_index.get(layout)
        if index is None:
            counts: list[int] = []
            for n, g in layout:
                counts += [g] * (n // g) + ([n % g] if n % g else [])
            index = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts)).to(device)
            self._group_index[layout] = index
        return index


def _batch_tokens(t: Encoded) -> int:
    """Tokens dequantized in one go: on a CPU sized for the caches; on a GPU one batch per run (bounded)."""
    return 1024 if t.data.device.type == "cpu" else 1 << 16


def _runs(items: list, kind, tokens, cap: int) -> list[list]:
    """Consecutive items of one batchable kind grouped, up to `cap` tokens per group; others alone. `tokens` is asked
    of batchable items only."""
    runs: list[list] = []
    last, held = None, 0
    for item in items:
        k = kind(item)
        n = tokens(item) if k is not None else 0
        if runs and k is not None and k == last and held + n <= cap:
            runs[-1].append(item)
            held += n
        else:
            runs.append([item])
            held = n
        last = k
    return runs


def _key_batch_kind(k: Encoded) -> tuple | None:
    """What a K encoding must share with its neighbours to be dequantized with them (None: alone)."""
    if not isinstance(k, QuantTensor) or k.axis != 1 or len(k.shape) != 3:
        return None
    if k.bits == 4 and k.shape[1] % 2:  # an odd row of int4 codes straddles a byte
        return None
    return (k.bits, k.dtype, k.shape[0], k.shape[2])


def _value_batch_kind(item: tuple[Encoded, int]) -> tuple | None:
    v, heads = item
    if not isinstance(v, QuantTensor) or v.axis != 1 or len(v.shape) != 2:
        return None
    if v.bits == 4 and (v.shape[0] * v.shape[1]) % 2:  # a trailing pad nibble
        return None
    return (v.bits, v.dtype, v.shape[1], v.group_size, heads)


def _values(run: list[tuple[Encoded, int]]) -> list[torch.Tensor]:
    """V is stored as codes of [tokens, heads * head_dim]: chunks concatenate along tokens into one QuantTensor."""
    if _value_batch_kind(run[0]) is None or len(run) == 1:
        return [decode_value(v, heads) for v, heads in run]
    qs: list[QuantTensor] = [v for v, _ in run]  # type: ignore[misc]
    n_tokens = sum(q.shape[0] for q in qs)
    q0, heads = qs[0], run[0][1]
    joined = replace(q0, data=torch.cat([q.data for q in qs]), scale=torch.cat([q.scale for q in qs]),
                     zero=torch.cat([q.zero for q in qs]), shape=(n_tokens, q0.shape[1]))
    return [dequantize_tensor(joined).reshape(n_tokens, heads, -1).permute(1, 0, 2)]


def _heads(k: Encoded) -> int:
    """K/V heads of a chunk's layer, from its K encoding (decode_value needs them to unflatten V)."""
    shape = k.shape if isinstance(k, QuantTensor) else tuple(k.shape)
    return shape[0] if len(shape) == 3 else 1

