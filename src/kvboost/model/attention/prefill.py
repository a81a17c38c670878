"""Prefill over a cached prefix: a FlashAttention-2 style Triton kernel. Row b with valid length end_b: query i sees
key j iff j <= end_b - q + i and key_valid[b, j]. Lengths are not constexpr, so new lengths never recompile."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .support import LOG2E, dot_in_fp32, kernel_inputs, padded_head_dim
from .tiles import attend_tiles


# Lengths, and strides that follow them, are not specialized (== 1 / % 16): a new length must not recompile.
@triton.jit(do_not_specialize=["n_heads", "q_len", "kv_len", "stride_valid_b"])
def _prefill_kernel(Q, K, V, Out, Ends, Valid,
                    stride_qb, stride_qh, stride_qm,
                    stride_kb, stride_kh, stride_kn,
                    stride_vb, stride_vh, stride_vn,
                    stride_ob, stride_oh, stride_om,
                    stride_valid_b,
                    n_heads, q_len, kv_len, qk_scale,
                    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, GROUP: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    HAS_ENDS: tl.constexpr, HAS_VALID: tl.constexpr, IEEE: tl.constexpr, DOT_F32: tl.constexpr):
    start_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // n_heads
    h = pid_bh % n_heads
    hk = h // GROUP
    b64, h64, hk64 = b.to(tl.int64), h.to(tl.int64), hk.to(tl.int64)  # byte offsets of large caches overflow int32

    end = kv_len
    if HAS_ENDS:
        end = tl.minimum(tl.load(Ends + b), kv_len)
    diag = end - q_len  # query i sees keys j <= i + diag

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    m_ok = offs_m < q_len
    d_ok = offs_d < HEAD_DIM
    q_ptrs = Q + b64 * stride_qb + h64 * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :]
    q = tl.load(q_ptrs, mask=m_ok[:, None] & d_ok[None, :], other=0.0)  # [M, D], stays in registers
    if DOT_F32:
        q = q.to(tl.float32)

    k_base = K + b64 * stride_kb + hk64 * stride_kh
    v_base = V + b64 * stride_vb + hk64 * stride_vh
    valid_base = Valid + b64 * stride_valid_b  # stride 0 (and never read) without a padding vector

    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)

    first_m = start_m * BLOCK_M
    last_m = tl.minimum(first_m + BLOCK_M, q_len) - 1
    hi = tl.maximum(tl.minimum(end, last_m + diag + 1), 0)  # keys past this are hidden from every query here
    # Tiles below `full` are visible to the block's first query, hence to all of its queries: no mask.
    full = tl.maximum(tl.minimum(end, first_m + diag + 1), 0) // BLOCK_N * BLOCK_N
    if HAS_VALID:  # the padding vector applies to every tile: all of them masked
        full = 0
    acc, l_i, m_i = attend_tiles(acc, l_i, m_i, q, k_base, v_base, valid_base, stride_kn, stride_vn,
                                  offs_m, offs_d, 0, full, end, diag, qk_scale,
                                  HEAD_DIM, D_PAD, BLOCK_N, False, False, IEEE, DOT_F32)
    acc, l_i, m_i = attend_tiles(acc, l_i, m_i, q, k_base, v_base, valid_base, stride_kn, stride_vn,
                                  offs_m, offs_d, full, hi, end, diag, qk_scale,
                                  HEAD_DIM, D_PAD, BLOCK_N, True, HAS_VALID, IEEE, DOT_F32)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # a query that saw no key: acc is 0, output 0
    out = acc / l_safe[:, None]
    o_ptrs = Out + b64 * stride_ob + h64 * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


def default_blocks(head_dim: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages), fixed per (head dim, dtype): no autotuning on a new length."""
    d_pad = padded_head_dim(head_dim)
    if dtype == torch.float32:
        return (64, 32, 4, 2) if d_pad <= 128 else (32, 32, 4, 1)
    if d_pad <= 64:
        return 128, 64, 4, 3
    if d_pad <= 128:
        return 128, 64, 8, 3
    return 64, 32, 4, 2


def prefill_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, scale: float,
                      kv_len: int | None = None, ends: torch.Tensor | None = None,
                      key_valid: torch.Tensor | None = None, block_m: int | None = None,
                      block_n: int | None = None) -> torch.Tensor:
    """Attention of query [B, Hq, q, d] over the first kv_len keys of key/value [B, Hkv, kv, d]. ends [B]: valid
    lengths; key_valid [B, >= kv_len]: True = may attend. Returns [B, Hq, q, d], a view of a [B, q, Hq, d] buffer."""
    query, key, value, kv_len, ends, key_valid = kernel_inputs(query, key, value, kv_len, ends, key_valid)
    b, hq, q_len, d = query.shape
    hkv = key.shape[1]
    bm, bn, warps, stages = default_blocks(d, query.dtype)
    bm, bn = block_m or bm, block_n or bn
    out = torch.empty(b, q_len, hq, d, dtype=query.dtype, device=query.device).transpose(1, 2)
    if b == 0 or q_len == 0:
        return out
    grid = (triton.cdiv(q_len, bm), b * hq)
    _prefill_kernel[grid](
        query, key, value, out,
        ends if ends is not None else query, key_valid if key_valid is not None else query,
        query.stride(0), query.stride(1), query.stride(2),
        key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        key_valid.stride(0) if key_valid is not None else 0,
        hq, q_len, kv_len, scale * LOG2E,
        HEAD_DIM=d, D_PAD=padded_head_dim(d), GROUP=hq // hkv, BLOCK_M=bm, BLOCK_N=bn,
        HAS_ENDS=ends is not None, HAS_VALID=key_valid is not None, IEEE=query.dtype == torch.float32,
        DOT_F32=dot_in_fp32(query.dtype),
        num_warps=warps, num_stages=stages,
    )
    return out
