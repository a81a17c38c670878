"""The tile math both kernels share (Triton device functions, inlined where called).

A key tile's scores, the online-softmax update of the running max m and denominator l (base 2), and the
probability-weighted values. Precision follows the kernels' flags: IEEE for fp32 inputs (no TF32), DOT_F32
under the CPU interpreter, which multiplies bf16 tiles wrongly unless they are widened first.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tile_scores(q, k, qk_scale, IEEE: tl.constexpr, DOT_F32: tl.constexpr):
    """q [M, D] x k [N, D] -> scaled scores [M, N] in fp32."""
    if DOT_F32:
        k = k.to(tl.float32)
    if IEEE or DOT_F32:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    return s * qk_scale


@triton.jit
def online_softmax(s, m_i, l_i):
    """Fold masked scores s [M, N] into the running (m, l); returns (p [M, N], alpha [M], m, l)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row that has seen no key yet keeps m = -inf; subtracting 0 instead avoids (-inf) - (-inf) = NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def weighted_values(p, v, IEEE: tl.constexpr, DOT_F32: tl.constexpr):
    """p [M, N] x v [N, D] in fp32; P is rounded to V's dtype first, as FlashAttention does."""
    if DOT_F32:  # the products are then exact in fp32
        pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
    elif IEEE:
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return pv
