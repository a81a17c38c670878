"""Int4Weights: a Linear weight [out, in] as 4-bit codes with a scale and a zero per group of `group` inputs.

One convention for every source, the one torch's int4pack kernels compute: w = (q - 8) * scale + zero, q in [0, 15].
GGUF Q4_0 (w = d * (q - 8)) and Q4_1 (w = d * q + m) map onto it exactly: scale = d, zero = 0 or m + 8d. Round to
nearest (`quantize_rtn`) is for float checkpoints without a quantized file.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

GROUPS = (32, 64, 128, 256)  # the group sizes torch's int4pack kernels take
GGUF_BLOCK = 32  # weights per GGUF Q4 block
_GGUF_LAYOUT = {"Q4_0": (18, False), "Q4_1": (20, True)}  # bytes per block, has a min (m)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [N, K] (0..15, K even) -> uint8 [N, K / 2]: byte j holds code 2j (low nibble) and 2j + 1 (high)."""
    if codes.shape[1] % 2:
        raise ValueError(f"{codes.shape[1]} inputs: packing two codes per byte needs an even count")
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """pack_nibbles' inverse: uint8 [N, K / 2] -> codes [N, K]."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(packed.shape[0], -1)


@dataclass
class Int4Weights:
    codes: torch.Tensor  # uint8 [out, in], values 0..15
    scales: torch.Tensor  # float32 [out, in / group]
    zeros: torch.Tensor  # float32 [out, in / group]
    group: int

    def __post_init__(self) -> None:
        out, cols = self.codes.shape
        if self.group not in GROUPS or cols % self.group:
            raise ValueError(f"group {self.group} must be one of {GROUPS} and divide the {cols} inputs")
        if self.scales.shape != (out, cols // self.group) or self.zeros.shape != self.scales.shape:
            raise ValueError(f"scales {tuple(self.scales.shape)} and zeros {tuple(self.zeros.shape)} must be "
                             f"[{out}, {cols // self.group}]")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [out, in] the codes stand for."""
        expand = lambda t: t.repeat_interleave(self.group, dim=1)  # noqa: E731 - [out, groups] -> [out, in]
        return (self.codes.float() - 8) * expand(self.scales) + expand(self.zeros)

    @classmethod
    def from_gguf(cls, kind: str, blocks: np.ndarray | torch.Tensor, shape: tuple[int, int]) -> Int4Weights:
        """A GGUF Q4_0 / Q4_1 tensor as stored: uint8 [out, in / 32 * block bytes]; shape: (out, in). Each block is
        an fp16 d (Q4_1: and an fp16 m), then 16 bytes whose low nibbles are weights 0-15, high nibbles 16-31."""
        if kind not in _GGUF_LAYOUT:
            raise ValueError(f"GGUF {kind} is not a 4-bit format this loader reads ({', '.join(_GGUF_LAYOUT)})")
        size, has_min = _GGUF_LAYOUT[kind]
        out, cols = shape
        raw = torch.from_numpy(np.array(blocks, dtype=np.uint8)).reshape(out, cols // GGUF_BLOCK, size)
        d = raw[..., 0:2].contiguous().view(torch.float16).float()[..., 0]  # [out, blocks]
        # w = d * q + m = d * (q - 8) + (m + 8d); Q4_0's w = d * (q - 8) has zero 0
        zeros = raw[..., 2:4].contiguous().view(torch.float16).float()[..., 0] + 8 * d if has_min else 0 * d
        qs = raw[..., size - 16:]
        return cls(torch.cat([qs & 0x0F, qs >> 4], dim=-1).reshape(out, cols), d, zeros, GGUF_BLOCK)

    @classmethod
    def quantize_rtn(cls, weight: torch.Tensor, group: int = 128) -> Int4Weights:
        """Round to nearest over each group's [min, max] (asymmetric): the error per weight is at most half a step."""
        out, cols = weight.shape
        if group not in GROUPS or cols % group:
            raise ValueError(f"group {group} must be one of {GROUPS} and divide the {cols} inputs")
        w = weight.detach().float().reshape(out, cols // group, group)
        low, high = w.amin(dim=-1), w.amax(dim=-1)
        scales = ((high - low) / 15).clamp_min(torch.finfo(torch.float32).tiny)
        codes = ((w - low[..., None]) / scales[..., None]).round().clamp(0, 15).to(torch.uint8).reshape(out, cols)
        return cls(codes, scales, low + 8 * scales, group)
