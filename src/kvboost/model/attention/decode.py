"""Flash-decoding: a few queries (decode, q = 1, or a short draft) over a long cache, split across programs.

One program per (key split, batch row, kv head) would sit idle on a GPU with B * Hkv programs of a long
sequential loop; instead the valid keys are cut into splits of `split_len` and every split runs in parallel:

  split kernel   grid (n_splits, B * Hkv): the GROUP query heads of one kv head and the q query positions are
                 folded into the matmul M dimension ([GROUP * q, d] @ [d, BLOCK_N]), so a K/V tile is loaded
                 once for every query head that reads it. Each program writes its partial result normalised
                 by its own softmax sum, plus that sum's log-sum-exp (base 2), or lse = -inf if it saw no key.
  reduce kernel  grid (B * Hkv): merges the same folded rows over the splits by log-sum-exp into
                 [B, Hq, q, d] in the input dtype.

Semantics are the prefill kernel's (prefill.py): bottom-right causal per row, per-row ends, an optional
per-key padding vector, 0 for a query that sees no key. Runtime values: q_len, kv_len, split_len, n_splits
(the grid) and the lengths; constexpr: head dim, dtype, GROUP, BLOCK_M = GROUP * q rounded up, BLOCK_N.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .support import (
    KernelUnsupportedError,
    check_lengths,
    dot_in_fp32,
    kernel_refusal,
    last_dim_contiguous,
    padded_head_dim,
)
from .tiles import online_softmax, tile_scores, weighted_values

LOG2E = 1.4426950408889634
MAX_FOLDED_ROWS = 128  # GROUP * q above this would spill registers: use the prefill kernel instead


# Lengths, and strides that follow them, are not specialized (== 1 / % 16): a new length must not recompile.
@triton.jit(do_not_specialize=["n_kv_heads", "q_len", "kv_len", "split_len", "stride_valid_b",
                               "stride_lb", "stride_lh", "stride_lm"])
def _decode_split_kernel(Q, K, V, MidO, MidL, Ends, Valid,
                         stride_qb, stride_qh, stride_qm,
                         stride_kb, stride_kh, stride_kn,
                         stride_vb, stride_vh, stride_vn,
                         stride_valid_b,
                         stride_mb, stride_mh, stride_mm, stride_ms,
                         stride_lb, stride_lh, stride_lm,
                         n_kv_heads, q_len, kv_len, split_len, qk_scale,
                         HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, GROUP: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         HAS_ENDS: tl.constexpr, HAS_VALID: tl.constexpr, IEEE: tl.constexpr,
                         DOT_F32: tl.constexpr):
    split = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // n_kv_heads
    hk = pid_bh % n_kv_heads
    b64 = b.to(tl.int64)

    end = kv_len
    if HAS_ENDS:
        end = tl.minimum(tl.load(Ends + b), kv_len)
    diag = end - q_len

    # Folded rows: row r is query head hk * GROUP + r // q_len at query position r % q_len.
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < GROUP * q_len
    head = (hk * GROUP + rows // q_len).to(tl.int64)
    qi = rows % q_len
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < HEAD_DIM
    q = tl.load(Q + b64 * stride_qb + head[:, None] * stride_qh + qi[:, None] * stride_qm + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [M, D]
    if DOT_F32:
        q = q.to(tl.float32)

    k_base = K + b64 * stride_kb + hk.to(tl.int64) * stride_kh
    v_base = V + b64 * stride_vb + hk.to(tl.int64) * stride_vh
    valid_base = Valid + b64 * stride_valid_b

    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    lo = split * split_len
    hi = tl.minimum(lo + split_len, end)
    offs_n0 = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        n_ok = offs_n < hi
        k = tl.load(k_base + offs_n[:, None] * stride_kn + offs_d[None, :],
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)  # [N, D]
        v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :],
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        s = tile_scores(q, k, qk_scale, IEEE, DOT_F32)
        # Decode is memory-bound: masking every tile costs nothing measurable, so there is one loop.
        keep = (offs_n[None, :] <= qi[:, None] + diag) & n_ok[None, :]
        if HAS_VALID:
            valid = tl.load(valid_base + offs_n, mask=n_ok, other=0)
            keep = keep & (valid[None, :] != 0)
        s = tl.where(keep, s, float("-inf"))
        p, alpha, m_i, l_i = online_softmax(s, m_i, l_i)
        acc = acc * alpha[:, None] + weighted_values(p, v, IEEE, DOT_F32)

    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    lse = tl.where(seen, m_i + tl.math.log2(l_safe), float("-inf"))
    hq = hk * GROUP + rows // q_len
    o_ptrs = (MidO + b64 * stride_mb + hq[:, None].to(tl.int64) * stride_mh + qi[:, None] * stride_mm
              + split * stride_ms + offs_d[None, :])
    tl.store(o_ptrs, acc / l_safe[:, None], mask=row_ok[:, None])  # pad lanes hold 0: stored, never read
    tl.store(MidL + b64 * stride_lb + hq.to(tl.int64) * stride_lh + qi * stride_lm + split, lse, mask=row_ok)


@triton.jit(do_not_specialize=["n_kv_heads", "q_len", "n_splits", "stride_lb", "stride_lh", "stride_lm"])
def _decode_reduce_kernel(MidO, MidL, Out,
                          stride_mb, stride_mh, stride_mm, stride_ms,
                          stride_lb, stride_lh, stride_lm,
                          stride_ob, stride_oh, stride_om,
                          n_kv_heads, q_len, n_splits,
                          HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, GROUP: tl.constexpr,
                          BLOCK_M: tl.constexpr):
    # One program per (row, kv head) merges the same folded rows its split programs wrote: [GROUP * q, D].
    pid = tl.program_id(0)
    b = (pid // n_kv_heads).to(tl.int64)
    hk = pid % n_kv_heads
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < GROUP * q_len
    head = (hk * GROUP + rows // q_len).to(tl.int64)
    qi = rows % q_len
    offs_d = tl.arange(0, D_PAD)
    o_base = MidO + b * stride_mb + head[:, None] * stride_mh + qi[:, None] * stride_mm + offs_d[None, :]
    l_base = MidL + b * stride_lb + head * stride_lh + qi * stride_lm
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    denom = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    for s in range(0, n_splits):
        lse = tl.load(l_base + s, mask=row_ok, other=float("-inf"))
        m_new = tl.maximum(m, lse)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m - m_safe)
        w = tl.math.exp2(lse - m_safe)  # 0 for a split that saw no key
        part = tl.load(o_base + s * stride_ms, mask=row_ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + w[:, None] * part
        denom = denom * alpha + w
        m = m_new
    denom = tl.where(denom == 0.0, 1.0, denom)  # a query that saw no key anywhere: 0
    out = acc / denom[:, None]
    o_ptrs = Out + b * stride_ob + head[:, None] * stride_oh + qi[:, None] * stride_om + offs_d[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM))


@functools.cache
def _program_slots(device_index: int) -> int:
    """Two resident programs per SM (264 on an H100)."""
    return 2 * torch.cuda.get_device_properties(device_index).multi_processor_count


def default_split_len(kv_len: int, batch: int, kv_heads: int, block_n: int, programs: int = 264) -> int:
    """Keys per split: enough splits that batch * kv_heads * splits fills ~`programs` slots, but never under 4
    tiles each (below that the reduce pass and the partial buffers cost more than they save)."""
    want = max(1, programs // max(1, batch * kv_heads))
    per = triton.cdiv(max(kv_len, 1), want)
    per = max(per, 4 * block_n)
    return triton.cdiv(per, block_n) * block_n


def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, scale: float,
                     kv_len: int | None = None, ends: torch.Tensor | None = None,
                     key_valid: torch.Tensor | None = None, split_len: int | None = None,
                     block_n: int | None = None) -> torch.Tensor:
    """Split-K attention of a few queries [B, Hq, q, d] (Hq / Hkv * q <= MAX_FOLDED_ROWS) over key/value
    [B, Hkv, kv, d]; same arguments and result as prefill.prefill_attention. Raises KernelUnsupportedError.

    The grid depends on kv_len / split_len only: a CUDA-graph capture over a static workspace passes
    kv_len = capacity, a fixed split_len and per-row `ends` (a device tensor updated in place between replays).
    """
    reason = kernel_refusal(query, key, value)
    if reason:
        raise KernelUnsupportedError(reason)
    b, hq, q_len, d = query.shape
    hkv, kv_cap = key.shape[1], key.shape[2]
    group = hq // hkv
    if group * q_len > MAX_FOLDED_ROWS:
        raise KernelUnsupportedError(f"{group} heads x {q_len} queries > {MAX_FOLDED_ROWS} folded rows: use prefill")
    kv_len = kv_cap if kv_len is None else int(kv_len)
    if not 0 <= kv_len <= kv_cap:
        raise KernelUnsupportedError(f"kv_len {kv_len} outside the key tensor's {kv_cap} columns")
    ends, key_valid = check_lengths(ends, key_valid, b, kv_len, query.device)
    query, key, value = last_dim_contiguous(query, key, value)
    d_pad = padded_head_dim(d)
    block_m = max(16, triton.next_power_of_2(group * q_len))
    bn = block_n or (64 if d_pad <= 128 else 32)
    slots = _program_slots(query.device.index or 0) if query.device.type == "cuda" else 264
    split = split_len or default_split_len(kv_len, b, hkv, bn, slots)
    if split % bn:
        raise KernelUnsupportedError(f"split_len {split} is not a multiple of block_n {bn}")
    n_splits = max(1, triton.cdiv(kv_len, split))
    warps = 8 if block_m * d_pad > 32 * 128 else 4  # the fp32 accumulator [BLOCK_M, D_PAD] lives in registers
    out = torch.empty(b, q_len, hq, d, dtype=query.dtype, device=query.device).transpose(1, 2)
    if b == 0 or q_len == 0:
        return out
    # Partials in fp32: [B, Hq, q, splits, D_PAD] normalised outputs and [B, Hq, q, splits] log2-sum-exp.
    mid_o = torch.empty(b, hq, q_len, n_splits, d_pad, dtype=torch.float32, device=query.device)
    mid_l = torch.empty(b, hq, q_len, n_splits, dtype=torch.float32, device=query.device)
    _decode_split_kernel[(n_splits, b * hkv)](
        query, key, value, mid_o, mid_l,
        ends if ends is not None else query, key_valid if key_valid is not None else query,
        query.stride(0), query.stride(1), query.stride(2),
        key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2),
        key_valid.stride(0) if key_valid is not None else 0,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_o.stride(3),
        mid_l.stride(0), mid_l.stride(1), mid_l.stride(2),
        hkv, q_len, kv_len, split, scale * LOG2E,
        HEAD_DIM=d, D_PAD=d_pad, GROUP=group, BLOCK_M=block_m, BLOCK_N=bn,
        HAS_ENDS=ends is not None, HAS_VALID=key_valid is not None, IEEE=query.dtype == torch.float32,
        DOT_F32=dot_in_fp32(query.dtype), num_warps=warps, num_stages=2,
    )
    _decode_reduce_kernel[(b * hkv,)](
        mid_o, mid_l, out,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_o.stride(3),
        mid_l.stride(0), mid_l.stride(1), mid_l.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        hkv, q_len, n_splits,
        HEAD_DIM=d, D_PAD=d_pad, GROUP=group, BLOCK_M=block_m, num_warps=4,
    )
    return out
