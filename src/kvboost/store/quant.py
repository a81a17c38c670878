"""KIVI-style asymmetric K/V quantization (int8 / int4) for the memory tier and the wire format.

K is quantized per channel: each (head, channel) gets its own scale/minimum per group of tokens, because
key outliers live in fixed channels (KIVI, Liu et al. 2024). V is quantized per token: each token's value
vector gets a scale/minimum per group of channels, because values have no channel outliers and the
attention output mixes them per token.

Scales and minimums are stored as fp16 (2 bytes each, 4 bytes per group). With the fp16 baseline at
2 bytes/element, int8 data alone is 0.5x, so groups must hold >= 100 elements for int8 to stay under
0.52x. K groups span the chunk's tokens (128 by default); the memory tier uses V groups of up to 256
channels of a token's flattened [heads * head_dim] vector (tiered.build_store), i.e. one group per token
for models with <= 256 K/V channels per layer. Measured on SmolLM2-135M (3 KV heads x 64): int8 0.516x,
int4 0.266x of fp16 (`kvboost bench quant`); V groups of 128 gave 0.521x / 0.271x.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import ChunkMeta, ChunkRecord

_FP16_MAX = 65504.0
_FP16_TINY = 2.0**-24  # smallest positive fp16 (subnormal): the floor for a scale

DEFAULT_GROUP_SIZE = 128


@dataclass
class QuantTensor:
    """A tensor quantized in groups along `axis`.

    data: uint8 codes in the original element order of the axis-moved-last view (int4: two per byte,
    low nibble first). scale/zero: fp16, shaped [*other_dims, n_groups]; x ~= code * scale + zero.
    """

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
        return sum(t.numel() * t.element_size() for t in (self.data, self.scale, self.zero))


def _round_toward(x16: torch.Tensor, exact: torch.Tensor, up: bool) -> torch.Tensor:
    """fp16 rounding that never lands on the wrong side of `exact`, so every value stays inside the grid."""
    wrong = x16.float() < exact if up else x16.float() > exact
    target = torch.full_like(x16, float("inf") if up else float("-inf"))
    return torch.where(wrong, _nextafter(x16, target), x16)


def _nextafter(x: torch.Tensor, toward: torch.Tensor) -> torch.Tensor:
    try:
        return torch.nextafter(x, toward)
    except (RuntimeError, NotImplementedError):
        # fp16 nextafter exists on CUDA only from torch 2.6 (and not on every backend): the CPU kernel has it.
        return torch.nextafter(x.cpu(), toward.cpu()).to(x.device)


def quantizable(x: torch.Tensor) -> bool:
    """fp16 scales cannot describe non-finite values or magnitudes past fp16 range: those stay raw."""
    if not x.is_floating_point() or x.numel() == 0:
        return False
    return bool(torch.isfinite(x).all()) and float(x.abs().max()) <= _FP16_MAX / 4


def quantize_tensor(x: torch.Tensor, bits: int, group_size: int = DEFAULT_GROUP_SIZE, axis: int = -1) -> QuantTensor:
    """Quantize `x` in groups of `group_size` consecutive elements along `axis` (the last group may be short).

    Error bound: |x - dequantize(q)| <= scale / 2 per element (plus float rounding), where
    scale = (group max - group min) / (2**bits - 1) rounded up to fp16.
    """
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if not quantizable(x):
        raise ValueError("tensor is empty, not floating point, non-finite or outside fp16 range")
    axis = axis % x.dim()
    qmax = (1 << bits) - 1
    moved = x.detach().movedim(axis, -1).float().contiguous()  # strided reductions are ~50x slower on CPU
    length = moved.shape[-1]
    g = min(group_size, length)
    n_groups = -(-length // g)
    pad = n_groups * g - length
    # Replicating the last element keeps a short group's min/max those of its real elements.
    padded = torch.cat([moved, moved[..., -1:].expand(*moved.shape[:-1], pad)], -1) if pad else moved
    groups = padded.reshape(*moved.shape[:-1], n_groups, g)
    mn = groups.amin(-1)
    mx = groups.amax(-1)
    zero16 = _round_toward(mn.half(), mn, up=False)
    scale_exact = ((mx - zero16.float()) / qmax).clamp_min(_FP16_TINY)
    scale16 = _round_toward(scale_exact.half(), scale_exact, up=True)
    scale, zero = scale16.float().unsqueeze(-1), zero16.float().unsqueeze(-1)
    codes = torch.round((groups - zero) / scale).clamp_(0, qmax).to(torch.uint8)
    codes = codes.reshape(*moved.shape[:-1], n_groups * g)[..., :length].reshape(-1)
    data = pack_int4(codes) if bits == 4 else codes.contiguous()
    return QuantTensor(data, scale16.contiguous(), zero16.contiguous(), bits, tuple(x.shape), axis, g, x.dtype)


def dequantize_tensor(q: QuantTensor) -> torch.Tensor:
    moved_shape = list(q.shape)
    length = moved_shape.pop(q.axis)
    moved_shape.append(length)
    numel = 1
    for d in moved_shape:
        numel *= d
    codes = unpack_int4(q.data, numel) if q.bits == 4 else q.data
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
        return sum(encoded_nbytes(t) for t in (*self.keys, *self.values))


def encoded_nbytes(t: Encoded) -> int:
    return t.nbytes if isinstance(t, QuantTensor) else t.numel() * t.element_size()


class QuantCodec:
    """MemoryStore Codec: encode(record) -> QuantRecord, decode -> ChunkRecord in the original dtype."""

    def __init__(self, bits: int, group_size: int = DEFAULT_GROUP_SIZE, v_group_size: int | None = None):
        if bits not in (4, 8):
            raise ValueError(f"QuantCodec bits must be 4 or 8, got {bits}")
        self.bits = bits
        self.group_size = group_size  # K: tokens per group
        self.v_group_size = v_group_size or group_size  # V: channels of a token's [heads*head_dim] per group

    def encode_key(self, k: torch.Tensor) -> Encoded:
        # [heads, tokens, head_dim]: group along tokens, separately for each (head, channel).
        return quantize_tensor(k, self.bits, self.group_size, axis=1) if quantizable(k) else k.detach()

    def encode_value(self, v: torch.Tensor) -> Encoded:
        # [heads, tokens, head_dim] -> [tokens, heads*head_dim]: group along each token's channels.
        if not quantizable(v) or v.dim() != 3:
            return v.detach()
        flat = v.detach().permute(1, 0, 2).reshape(v.shape[1], -1)
        return quantize_tensor(flat, self.bits, self.v_group_size, axis=1)

    def encode(self, record: ChunkRecord) -> QuantRecord:
        return QuantRecord(record.meta(), [self.encode_key(k) for k in record.keys],
                           [self.encode_value(v) for v in record.values], self.bits)

    def decode(self, payload: QuantRecord) -> ChunkRecord:
        m = payload.meta
        n_tokens = len(m.token_ids)
        keys = [decode_key(k) for k in payload.keys]
        values = [decode_value(v, n_tokens, k) for v, k in zip(payload.values, keys)]
        return ChunkRecord(m.key, m.parent_key, m.content_key, m.token_ids, m.start, keys, values)

    def nbytes(self, payload: QuantRecord) -> int:
        return payload.nbytes


def decode_key(k: Encoded) -> torch.Tensor:
    return dequantize_tensor(k) if isinstance(k, QuantTensor) else k


def decode_value(v: Encoded, n_tokens: int, like: torch.Tensor) -> torch.Tensor:
    if not isinstance(v, QuantTensor):
        return v
    flat = dequantize_tensor(v)  # [tokens, heads*head_dim]
    heads = like.shape[0] if like.dim() == 3 else 1
    return flat.reshape(n_tokens, heads, -1).permute(1, 0, 2).contiguous()


def fp16_baseline_bytes(record: ChunkRecord) -> int:
    """What the same K/V would take at 2 bytes per element: the reference for compression ratios."""
    return 2 * sum(t.numel() for t in (*record.keys, *record.values))
