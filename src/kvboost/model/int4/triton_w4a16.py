"""W4A16 matrix product in Triton: y [M, N] = x [M, K] @ W^T, W read as packed 4-bit codes and dequantized in the tile.

Weights stay packed in memory (two codes per byte along K, even k in the low nibble: `pack_nibbles`), with a scale and
a zero per group of inputs (Int4Weights' convention, w = (q - 8) * scale + zero), so a decode step reads a quarter of
fp16's bytes. Each program computes a [BLOCK_M, BLOCK_N] tile over K: it loads the x tile and the code bytes, turns
them into a [BLOCK_N, BLOCK_K] weight tile in registers and accumulates tl.dot in fp32. One kernel serves decode
(M = 1, padded to tl.dot's 16 rows) and prefill. Runs on CUDA, and in Triton's interpreter for tests.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from ..attention.support import dot_in_fp32
from .weights import Int4Weights, pack_nibbles

if TYPE_CHECKING:
    from .linear import Int4Linear

BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 64


@triton.jit
def _w4a16_kernel(X, Packed, Scales, Zeros, Out, M, N, K,
                  stride_xm, stride_pn, stride_sn, stride_om,
                  GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  DOT_F32: tl.constexpr, IEEE: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = rm < M, rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        x = tl.load(X + rm[:, None] * stride_xm + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        wk = n_ok[:, None] & k_ok[None, :]
        byte = tl.load(Packed + rn[:, None] * stride_pn + rk[None, :] // 2, mask=wk, other=0).to(tl.int32)
        q = (byte >> ((rk[None, :] % 2) * 4)) & 0xF  # [BLOCK_N, BLOCK_K]
        group = rn[:, None] * stride_sn + rk[None, :] // GROUP
        scale = tl.load(Scales + group, mask=wk, other=0.0).to(tl.float32)
        zero = tl.load(Zeros + group, mask=wk, other=0.0).to(tl.float32)
        w = (q.to(tl.float32) - 8.0) * scale + zero
        if DOT_F32:
            acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee" if IEEE else "tf32")
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    out = Out + rm[:, None] * stride_om + rn[None, :]
    tl.store(out, acc.to(Out.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


class W4A16Weights:
    """Int4Weights laid out for the kernel on `device`: packed codes [N, K / 2], scales and zeros [N, K / group]."""

    def __init__(self, weights: Int4Weights, device: torch.device | str):
        self.out_features, self.in_features = weights.shape
        self.group = weights.group
        self.packed = pack_nibbles(weights.codes).to(device)
        self.scales = weights.scales.float().contiguous().to(device)
        self.zeros = weights.zeros.float().contiguous().to(device)


def w4a16_matmul(x: torch.Tensor, weights: W4A16Weights | Int4Linear) -> torch.Tensor:
    """x [..., K] (fp16, bf16 or fp32) @ W^T -> [..., N] in x's dtype, fp32 accumulation; fp32 inputs multiply in
    IEEE fp32. `weights`: W4A16Weights, or an Int4Linear of the triton kernel (it holds the same tensors)."""
    flat = x.reshape(-1, weights.in_features).contiguous()
    m = flat.shape[0]
    out = torch.empty(m, weights.out_features, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(weights.out_features, BLOCK_N))
    _w4a16_kernel[grid](flat, weights.packed, weights.scales, weights.zeros, out, m, weights.out_features,
                        weights.in_features, flat.stride(0), weights.packed.stride(0), weights.scales.stride(0),
                        out.stride(0), GROUP=weights.group, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                        DOT_F32=x.dtype == torch.float32 or dot_in_fp32(x.dtype), IEEE=x.dtype == torch.float32)
    return out.reshape(*x.shape[:-1], weights.out_features)
