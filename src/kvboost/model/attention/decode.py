"""Split-K attention (flash-decoding) over long caches, where the prefill kernel's grid would leave the GPU idle: a
kv head's query heads and positions fold into the M dimension, splits merge by log-sum-exp. Launches: shapes only."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .support import LOG2E, KernelUnsupportedError, dot_in_fp32, kernel_inputs, padded_head_dim
from .tiles import attend_tiles

INTERPRETER_SMS = 132  # the SM count assumed off CUDA (an H100's): plans stay the same on CPU as on the GPU
MIN_SPLIT_TILES = 2  # a shorter split costs more in partial traffic and reduce work than its parallelism saves
WAVES = 1  # programs per SM the split count aims for (a 128-row program fills an SM's registers)
REDUCE_BLOCK_M = 8  # folded rows per reduce program: a [rows, splits, d] fp32 tile must stay in registers
REDUCE_BLOCK_S = 8  # splits merged per step of the reduce


# Lengths, and strides that follow them, are not specialized (== 1 / % 16): a new length must not recompile.
@triton.jit(do_not_specialize=["n_kv_heads", "q_len", "kv_len", "split_len", "stride_valid_b",
                               "stride_ob", "stride_os", "stride_lb", "stride_ls"])
def _split_kernel(Q, K, V, MidO, MidL, Ends, Valid,
                  stride_qb, stride_qh, stride_qm,
                  stride_kb, stride_kh, stride_kn,
                  stride_vb, stride_vh, stride_vn,
                  stride_valid_b,
                  stride_ob, stride_os, stride_lb, stride_ls,
                  n_kv_heads, q_len, kv_len, split_len, qk_scale,
                  HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, GROUP: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  HAS_ENDS: tl.constexpr, HAS_VALID: tl.constexpr, IEEE: tl.constexpr, DOT_F32: tl.constexpr):
    tile = tl.program_id(0)
    split = tl.program_id(1)
    pid_bh = tl.program_id(2)
    b = pid_bh // n_kv_heads
    hk = pid_bh % n_kv_heads
    b64 = b.to(tl.int64)

    end = kv_len
    if HAS_ENDS:
        end = tl.maximum(tl.minimum(tl.load(Ends + b).to(tl.int32), kv_len), 0)
    # The program's rows (row r: query r // GROUP of head r % GROUP) and the split's keys [lo, split_end): query i sees
    # keys j <= i + diag, none of the block's queries a key past hi, and all of them the tiles below `full` (no mask).
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
    lse = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    # MidO/MidL are [B * Hkv, n_splits, GROUP * q, (HEAD_DIM)]: this program's block is contiguous.
    l_ptrs = MidL + pid_bh.to(tl.int64) * stride_lb + split * stride_ls + rows
    if hi > lo:  # else: past the row's end, or above the causal diagonal of every row: no load at all
        head = (hk * GROUP + rows % GROUP).to(tl.int64)
        offs_d = tl.arange(0, D_PAD)
        d_ok = offs_d < HEAD_DIM
        q = tl.load(Q + b64 * stride_qb + head[:, None] * stride_qh + qi[:, None] * stride_qm + offs_d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [M, D]
        if DOT_F32:
            q = q.to(tl.float32)
        k_base = K + b64 * stride_kb + hk.to(tl.int64) * stride_kh
        v_base = V + b64 * stride_vb + hk.to(tl.int64) * stride_vh
        valid_base = Valid + b64 * stride_valid_b  # stride 0 (and never read) without a padding vector

        acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        if HAS_VALID:  # the padding vector applies to every tile: all of them masked
            full = lo
        acc, l_i, m_i = attend_tiles(acc, l_i, m_i, q, k_base, v_base, valid_base, stride_kn, stride_vn,
                                     qi, offs_d, lo, full, split_end, diag, qk_scale,
                                     HEAD_DIM, D_PAD, BLOCK_N, False, False, IEEE, DOT_F32)
        acc, l_i, m_i = attend_tiles(acc, l_i, m_i, q, k_base, v_base, valid_base, stride_kn, stride_vn,
                                     qi, offs_d, full, hi, split_end, diag, qk_scale,
                                     HEAD_DIM, D_PAD, BLOCK_N, True, HAS_VALID, IEEE, DOT_F32)
        # The split's normalized output, and each row's log2-sum-exp (-inf: it saw no key).
        seen = l_i > 0.0
        l_safe = tl.where(seen, l_i, 1.0)
        lse = tl.where(seen, m_i + tl.math.log2(l_safe), float("-inf"))
        o_base = MidO + pid_bh.to(tl.int64) * stride_ob + split * stride_os
        tl.store(o_base + rows[:, None] * HEAD_DIM + offs_d[None, :], acc / l_safe[:, None],
                 mask=(row_ok & seen)[:, None] & d_ok[None, :])
    tl.store(l_ptrs, lse, mask=row_ok)


@triton.jit(do_not_specialize=["n_kv_heads", "q_len", "kv_len", "split_len", "n_splits",
                               "stride_ob", "stride_os", "stride_lb", "stride_ls", "stride_outb", "stride_outh",
                               "stride_outm"])
def _reduce_kernel(MidO, MidL, Out, Ends,
                   stride_ob, stride_os, stride_lb, stride_ls,
                   stride_outb, stride_outh, stride_outm,
                   n_kv_heads, q_len, kv_len, split_len, n_splits,
                   HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, GROUP: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr, HAS_ENDS: tl.constexpr):
    # BLOCK_S splits per step, loaded as one [M, S, D] tile: n_splits / BLOCK_S memory round trips instead of n_splits.
    tile = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // n_kv_heads).to(tl.int64)
    hk = pid_bh % n_kv_heads
    n_live = n_splits
    if HAS_ENDS:  # splits at or past the row's end were not computed (their lse is -inf): skip them
        end = tl.maximum(tl.minimum(tl.load(Ends + b).to(tl.int32), kv_len), 0)
        n_live = tl.minimum((end + split_len - 1) // split_len, n_splits)
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < GROUP * q_len
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < HEAD_DIM
    o_base = (MidO + pid_bh.to(tl.int64) * stride_ob + offs_s[None, :, None] * stride_os
              + rows[:, None, None] * HEAD_DIM + offs_d[None, None, :])  # [M, S, D]
    l_base = MidL + pid_bh.to(tl.int64) * stride_lb + offs_s[None, :] * stride_ls + rows[:, None]  # [M, S]
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    denom = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    for s0 in range(0, n_live, BLOCK_S):
        s_ok = (s0 + offs_s) < n_live
        lse = tl.load(l_base + s0 * stride_ls, mask=row_ok[:, None] & s_ok[None, :], other=float("-inf"))
        # A partial row that saw no key was never written: load without waiting for lse, then drop it.
        part = tl.load(o_base + s0 * stride_os, mask=(row_ok[:, None] & s_ok[None, :])[:, :, None]
                       & d_ok[None, None, :], other=0.0)
        m_new = tl.maximum(m, tl.max(lse, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m - m_safe)
        w = tl.math.exp2(lse - m_safe[:, None])  # [M, S]; 0 for a split that saw no key
        part = tl.where((lse > float("-inf"))[:, :, None], part, 0.0)
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * part, 1)
        denom = denom * alpha + tl.sum(w, 1)
        m = m_new
    denom = tl.where(denom == 0.0, 1.0, denom)  # a query that saw no key anywhere: 0
    out = acc / denom[:, None]
    head = (hk * GROUP + rows % GROUP).to(tl.int64)
    qi = rows // GROUP
    o_ptrs = Out + b * stride_outb + head[:, None] * stride_outh + qi[:, None] * stride_outm + offs_d[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@functools.cache
def _cuda_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (INTERPRETER_SMS off CUDA, so CPU tests plan like an H100)."""
    if device.type != "cuda":
        return INTERPRETER_SMS
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


@dataclass(frozen=True)
class SplitPlan:
    """Launch parameters of the split kernel, a function of shapes only (never of the values in `ends`)."""

    block_m: int  # folded rows per program
    block_n: int  # keys per tile
    split_len: int  # keys per split, a multiple of block_n
    n_splits: int
    row_tiles: int
    num_warps: int
    num_stages: int


@functools.lru_cache(maxsize=256)  # pure in its arguments (and the constants above): host time on every call
def split_plan(q_len: int, kv_len: int, batch: int, q_heads: int, kv_heads: int, head_dim: int,
               dtype: torch.dtype, sms: int, *, split_len: int | None = None, block_m: int | None = None,
               block_n: int | None = None) -> SplitPlan:
    """Tiles and split length: row tiles of up to 128 (64 for fp32 or d > 128), then as many splits as fit WAVES x `sms`
    programs, each at least MIN_SPLIT_TILES key tiles. Shapes only, never `ends`."""
    d_pad = padded_head_dim(head_dim)
    rows = q_heads // kv_heads * q_len
    small = dtype == torch.float32 or d_pad > 128
    bm = block_m or min(64 if small else 128, max(16, triton.next_power_of_2(max(rows, 1))))
    bn = block_n or (32 if small else 64)
    row_tiles = max(1, triton.cdiv(rows, bm))
    if split_len is None:
        # Rounded down: one program past a full wave costs a whole second wave.
        want = max(1, WAVES * sms // (batch * kv_heads * row_tiles))
        per = max(triton.cdiv(max(kv_len, 1), want), MIN_SPLIT_TILES * bn)
        split_len = triton.cdiv(per, bn) * bn
    if split_len <= 0 or split_len % bn:
        raise KernelUnsupportedError(f"split_len {split_len} is not a positive multiple of block_n {bn}")
    n_splits = max(1, triton.cdiv(kv_len, split_len))
    warps = 8 if bm * d_pad >= 128 * 128 else 4  # the fp32 accumulator [BLOCK_M, D_PAD] lives in registers
    # 3 stages of K/V tiles in flight (48-96 KB of shared memory) beat 2 on long splits.
    return SplitPlan(bm, bn, split_len, n_splits, row_tiles, warps, 3)


def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, scale: float,
                     kv_len: int | None = None, ends: torch.Tensor | None = None,
                     key_valid: torch.Tensor | None = None, split_len: int | None = None,
                     block_m: int | None = None, block_n: int | None = None) -> torch.Tensor:
    """Split-K attention, arguments and result as prefill.prefill_attention (KernelUnsupportedError)."""
    query, key, value, kv_len, ends, key_valid = kernel_inputs(query, key, value, kv_len, ends, key_valid)
    b, hq, q_len, d = query.shape
    hkv = key.shape[1]
    group = hq // hkv
    plan = split_plan(q_len, kv_len, b, hq, hkv, d, query.dtype, sm_count(query.device), split_len=split_len,
                      block_m=block_m, block_n=block_n)
    out = torch.empty(b, q_len, hq, d, dtype=query.dtype, device=query.device).transpose(1, 2)
    if b == 0 or q_len == 0:
        return out
    rows = group * q_len
    # Partials in fp32: normalised outputs [B * Hkv, splits, rows, d] and their log2-sum-exp [B * Hkv, splits, rows].
    mid_o = torch.empty(b * hkv, plan.n_splits, rows, d, dtype=torch.float32, device=query.device)
    mid_l = torch.empty(b * hkv, plan.n_splits, rows, dtype=torch.float32, device=query.device)
    ends_arg = ends if ends is not None else mid_l  # a dummy pointer, never read without HAS_ENDS
    _split_kernel[(plan.row_tiles, plan.n_splits, b * hkv)](
        query, key, value, mid_o, mid_l, ends_arg, key_valid if key_valid is not None else query,
        query.stride(0), query.stride(1), query.stride(2),
        key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2),
        key_valid.stride(0) if key_valid is not None else 0,
        mid_o.stride(0), mid_o.stride(1), mid_l.stride(0), mid_l.stride(1),
        hkv, q_len, kv_len, plan.split_len, scale * LOG2E,
        HEAD_DIM=d, D_PAD=padded_head_dim(d), GROUP=group, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n,
        HAS_ENDS=ends is not None, HAS_VALID=key_valid is not None, IEEE=query.dtype == torch.float32,
        DOT_F32=dot_in_fp32(query.dtype), num_warps=plan.num_warps, num_stages=plan.num_stages,
    )
    # Merge the partials by log-sum-exp, in fixed reduce tiles (masked where rows or splits are fewer): one compile per
    # head dim, group and flags.
    _reduce_kernel[(triton.cdiv(rows, REDUCE_BLOCK_M), b * hkv)](
        mid_o, mid_l, out, ends_arg,
        mid_o.stride(0), mid_o.stride(1), mid_l.stride(0), mid_l.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        hkv, q_len, kv_len, plan.split_len, plan.n_splits,
        HEAD_DIM=d, D_PAD=padded_head_dim(d), GROUP=group, BLOCK_M=REDUCE_BLOCK_M, BLOCK_S=REDUCE_BLOCK_S,
        HAS_ENDS=ends is not None, num_warps=8 if REDUCE_BLOCK_M * REDUCE_BLOCK_S * padded_head_dim(d) > 4096 else 4,
    )
    return out
