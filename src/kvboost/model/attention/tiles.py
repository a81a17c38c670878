"""The tile math both kernels share (Triton device functions): the key-tile loop with the online softmax (base 2)."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def attend_tiles(acc, l_i, m_i, q, k_base, v_base, valid_base, stride_kn, stride_vn,
                 offs_m, offs_d, n_lo, n_hi, end, diag, qk_scale,
                 HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                 MASKED: tl.constexpr, HAS_VALID: tl.constexpr, IEEE: tl.constexpr, DOT_F32: tl.constexpr):
    """Fold key tiles [n_lo, n_hi) into the running (acc [M, D], l [M], m [M]). MASKED: the causal mask, `end` and the
    padding vector apply; unmasked calls must cover only tiles every query of the block sees in full."""
    offs_n0 = tl.arange(0, BLOCK_N)
    d_ok = offs_d < HEAD_DIM  # all-true unless the head dim was padded (80, 96 -> 128)
    for start_n in range(n_lo, n_hi, BLOCK_N):
        offs_n = start_n + offs_n0
        n_ok = offs_n < end
        k = tl.load(k_base + offs_n[:, None] * stride_kn + offs_d[None, :],
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)  # [N, D]
        if DOT_F32:
            k = k.to(tl.float32)
        if IEEE or DOT_F32:
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale  # [M, N] fp32
        else:
            s = tl.dot(q, tl.trans(k)) * qk_scale
        if MASKED:
            keep = (offs_n[None, :] <= offs_m[:, None] + diag) & n_ok[None, :]
            if HAS_VALID:
                valid = tl.load(valid_base + offs_n, mask=n_ok, other=0)
                keep = keep & (valid[None, :] != 0)
            s = tl.where(keep, s, float("-inf"))
        # Online softmax in base 2. A row that has seen no key yet keeps m = -inf; subtracting 0 instead avoids
        # (-inf) - (-inf) = NaN.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
        v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :],
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)  # [N, D]
        # P is rounded to V's dtype first, as FlashAttention does (with DOT_F32 the products are then exact in fp32).
        if DOT_F32:
            pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
        elif IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
    return acc, l_i, m_i
