"""The tile math both kernels share (Triton device functions): the key-tile loop with the online softmax (base 2)."""
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
        s = tile_scores(q, k, qk_scale, IEEE, DOT_F32)  # [M, N] fp32
        if MASKED:
            keep = (offs_n[None, :] <= offs_m[:, None] + diag) & n_ok[None, :]
            if HAS_VALID:
                valid = tl.load(valid_base + offs_n, mask=n_ok, other=0)
                keep = keep & (valid[None, :] != 0)
            s = tl.where(keep, s, float("-inf"))
        p, alpha, m_i, l_i = online_softmax(s, m_i, l_i)
        v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :],
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)  # [N, D]
        acc = acc * alpha[:, None] + weighted_values(p, v, IEEE, DOT_F32)
    return acc, l_i, m_i


# ---- the split-K programs' frame (decode.py): which rows and keys a program owns, and its output ----
@triton.jit
def split_frame(tile, split, split_len, end, q_len, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """A split-K program's rows (row r: query r // GROUP of head r % GROUP) and keys. Returns rows [M], row_ok, qi, diag
    (query i sees keys j <= i + diag), the split's keys [lo, split_end), hi and full (tiles below it need no mask)."""
    diag = end - q_len
    n_rows = GROUP * q_len
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    qi = rows // GROUP
    first_q = tile * BLOCK_M // GROUP
    last_q = (tl.minimum(tile * BLOCK_M + BLOCK_M, n_rows) - 1) // GROUP
    lo = split * split_len
    split_end = tl.minimum(lo + split_len, end)
    hi = tl.maximum(tl.minimum(split_end, last_q + diag + 1), lo)
    full = lo + tl.maximum(tl.minimum(split_end, first_q + diag + 1) - lo, 0) // BLOCK_N * BLOCK_N
    return rows, row_ok, qi, diag, lo, split_end, hi, full


@triton.jit
def load_group_queries(q_base, hk, rows, row_ok, qi, stride_qh, stride_qm,
                       HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, GROUP: tl.constexpr, DOT_F32: tl.constexpr):
    """The program's queries [M, D_PAD] (q_base: this batch row's Q), with offs_d and d_ok for the head dim."""
    head = (hk * GROUP + rows % GROUP).to(tl.int64)
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < HEAD_DIM
    q = tl.load(q_base + head[:, None] * stride_qh + qi[:, None] * stride_qm + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    return q, offs_d, d_ok


@triton.jit
def store_partial(acc, l_i, m_i, o_base, rows, row_ok, offs_d, d_ok, HEAD_DIM: tl.constexpr):
    """Store the split's normalized output at o_base [rows, HEAD_DIM]; returns each row's log2-sum-exp (-inf: none)."""
    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    lse = tl.where(seen, m_i + tl.math.log2(l_safe), float("-inf"))
    tl.store(o_base + rows[:, None] * HEAD_DIM + offs_d[None, :], acc / l_safe[:, None],
             mask=(row_ok & seen)[:, None] & d_ok[None, :])
    return lse
