"""Split-K attention through a block table: the decode.py kernel with keys and values read from pool blocks.

Inputs: query [B, Hq, q, d]; key_cache / value_cache [num_blocks, Hkv, block_size, d], one layer's view of the
block pool (kv/blocks.py: storage[:, layer, 0] and storage[:, layer, 1], strided, last dim contiguous);
block_tables [B, W] int32 (row b's position p lives in slot p % block_size of block block_tables[b, p // bs]);
lengths [B] (row b holds end_b = min(lengths[b], W * bs) positions).

Semantics are the contiguous kernels' (prefill.py / decode.py): query i of row b sits at position end_b - q + i
and sees keys j <= end_b - q + i (bottom-right causal over cached + new keys); no key at or past end_b is read,
so table entries past a row's blocks may hold anything; a query that sees no key returns 0. GQA without repeated
K/V: the GROUP query heads of a kv head and the q queries are folded into the matmul rows, as in decode.py.

Each key tile looks its keys' blocks up in the table (one int per key, masked past the row's end), so any block
size works with any tile width. Grid (row tiles, splits, B * Hkv) and the split plan are decode.py's, from shapes
only (kv_len = W * bs): the launch is the same for every value in `lengths` and `block_tables` (CUDA graphs), and
the partials are merged by decode.py's reduce kernel.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .decode import LOG2E, reduce_splits, sm_count, split_plan
from .support import KERNEL_DTYPES, MAX_HEAD_DIM, KernelUnsupportedError, dot_in_fp32, padded_head_dim
from .tiles import load_group_queries, online_softmax, split_frame, store_partial, tile_scores, weighted_values


@triton.jit
def _attend_paged_tiles(acc, l_i, m_i, q, k_base, v_base, table_base, stride_kblk, stride_kn, stride_vblk,
                        stride_vn, offs_m, offs_d, n_lo, n_hi, end, diag, qk_scale,
                        HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                        MASKED: tl.constexpr, IEEE: tl.constexpr, DOT_F32: tl.constexpr):
    """tiles.attend_tiles with each key's address taken from the block table."""
    offs_n0 = tl.arange(0, BLOCK_N)
    d_ok = offs_d < HEAD_DIM
    for start_n in range(n_lo, n_hi, BLOCK_N):
        offs_n = start_n + offs_n0
        n_ok = offs_n < end
        blk = tl.load(table_base + offs_n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)  # [N]
        slot = offs_n % BLOCK_SIZE
        kv_ok = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + blk[:, None] * stride_kblk + slot[:, None] * stride_kn + offs_d[None, :],
                    mask=kv_ok, other=0.0)  # [N, D]
        s = tile_scores(q, k, qk_scale, IEEE, DOT_F32)  # [M, N] fp32
        if MASKED:
            keep = (offs_n[None, :] <= offs_m[:, None] + diag) & n_ok[None, :]
            s = tl.where(keep, s, float("-inf"))
        p, alpha, m_i, l_i = online_softmax(s, m_i, l_i)
        v = tl.load(v_base + blk[:, None] * stride_vblk + slot[:, None] * stride_vn + offs_d[None, :],
                    mask=kv_ok, other=0.0)  # [N, D]
        acc = acc * alpha[:, None] + weighted_values(p, v, IEEE, DOT_F32)
    return acc, l_i, m_i


# Lengths, and strides that follow them, are not specialized (== 1 / % 16): a new length must not recompile.
@triton.jit(do_not_specialize=["n_kv_heads", "q_len", "kv_len", "split_len", "stride_tb",
                               "stride_ob", "stride_os", "stride_lb", "stride_ls"])
def _paged_split_kernel(Q, KC, VC, Tables, MidO, MidL, Ends,
                        stride_qb, stride_qh, stride_qm,
                        stride_kblk, stride_kh, stride_kn,
                        stride_vblk, stride_vh, stride_vn,
                        stride_tb,
                        stride_ob, stride_os, stride_lb, stride_ls,
                        n_kv_heads, q_len, kv_len, split_len, qk_scale,
                        HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, GROUP: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                        IEEE: tl.constexpr, DOT_F32: tl.constexpr):
    tile = tl.program_id(0)
    split = tl.program_id(1)
    pid_bh = tl.program_id(2)
    b = pid_bh // n_kv_heads
    hk = pid_bh % n_kv_heads
    b64 = b.to(tl.int64)

    end = tl.maximum(tl.minimum(tl.load(Ends + b).to(tl.int32), kv_len), 0)
    rows, row_ok, qi, diag, lo, split_end, hi, full = split_frame(tile, split, split_len, end, q_len,
                                                                   GROUP, BLOCK_M, BLOCK_N)
    lse = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_ptrs = MidL + pid_bh.to(tl.int64) * stride_lb + split * stride_ls + rows
    if hi > lo:  # else: past the row's end, or above the causal diagonal of every row: no load at all
        q, offs_d, d_ok = load_group_queries(Q + b64 * stride_qb, hk, rows, row_ok, qi, stride_qh, stride_qm,
                                             HEAD_DIM, D_PAD, GROUP, DOT_F32)  # [M, D]
        k_base = KC + hk.to(tl.int64) * stride_kh
        v_base = VC + hk.to(tl.int64) * stride_vh
        table_base = Tables + b64 * stride_tb

        acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        acc, l_i, m_i = _attend_paged_tiles(acc, l_i, m_i, q, k_base, v_base, table_base, stride_kblk, stride_kn,
                                            stride_vblk, stride_vn, qi, offs_d, lo, full, split_end, diag, qk_scale,
                                            HEAD_DIM, BLOCK_N, BLOCK_SIZE, False, IEEE, DOT_F32)
        acc, l_i, m_i = _attend_paged_tiles(acc, l_i, m_i, q, k_base, v_base, table_base, stride_kblk, stride_kn,
                                            stride_vblk, stride_vn, qi, offs_d, full, hi, split_end, diag, qk_scale,
                                            HEAD_DIM, BLOCK_N, BLOCK_SIZE, True, IEEE, DOT_F32)
        lse = store_partial(acc, l_i, m_i, MidO + pid_bh.to(tl.int64) * stride_ob + split * stride_os, rows, row_ok,
                            offs_d, d_ok, HEAD_DIM)
    tl.store(l_ptrs, lse, mask=row_ok)


def paged_refusal(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                  block_tables: torch.Tensor, lengths: torch.Tensor) -> str | None:
    """Why the paged kernel cannot take these inputs (None: it can). Shapes and dtypes only: no sync."""
    if query.dim() != 4 or key_cache.dim() != 4 or value_cache.dim() != 4:
        return "query [B, Hq, q, d] and key/value caches [blocks, Hkv, block_size, d] must be 4-D"
    b, hq, _, d = query.shape
    if key_cache.shape != value_cache.shape:
        return f"key cache {tuple(key_cache.shape)} != value cache {tuple(value_cache.shape)}"
    if key_cache.shape[-1] != d or not 0 < d <= MAX_HEAD_DIM:
        return f"head dims: query {d}, cache {key_cache.shape[-1]} (kernels take equal dims up to {MAX_HEAD_DIM})"
    if hq % key_cache.shape[1]:
        return f"{hq} query heads are not a multiple of {key_cache.shape[1]} kv heads"
    if not (query.dtype == key_cache.dtype == value_cache.dtype) or query.dtype not in KERNEL_DTYPES:
        return f"dtypes {query.dtype}/{key_cache.dtype}/{value_cache.dtype} (one of fp16, bf16, fp32)"
    if block_tables.dim() != 2 or block_tables.shape[0] != b or block_tables.dtype not in (torch.int32, torch.int64):
        return f"block_tables must be [B, W] = [{b}, W] int32/int64, got {tuple(block_tables.shape)}"
    if lengths.shape != (b,) or lengths.dtype not in (torch.int32, torch.int64):
        return f"lengths must be [B] = [{b}] int32/int64, got {tuple(lengths.shape)} {lengths.dtype}"
    devices = {query.device, key_cache.device, value_cache.device, block_tables.device, lengths.device}
    if len(devices) != 1:
        return f"inputs on several devices: {sorted(map(str, devices))}"
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        return "the caches' last dim must be contiguous (a pool view is)"
    return None


def paged_attention_triton(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, lengths: torch.Tensor, *, scale: float,
                           split_len: int | None = None, block_m: int | None = None,
                           block_n: int | None = None) -> torch.Tensor:
    """Attention of query [B, Hq, q, d] over each row's blocks -> [B, Hq, q, d] in the query's dtype (a view of a
    [B, q, Hq, d] buffer, as the contiguous kernels return). Raises KernelUnsupportedError for inputs it cannot
    run. The launch depends on shapes only (B, heads, q, W, block size, d), never on the values of the tables
    or lengths."""
    reason = paged_refusal(query, key_cache, value_cache, block_tables, lengths)
    if reason:
        raise KernelUnsupportedError(reason)
    b, hq, q_len, d = query.shape
    hkv, block_size = key_cache.shape[1], key_cache.shape[2]
    group = hq // hkv
    kv_len = block_tables.shape[1] * block_size  # the capacity the tables address
    if query.stride(-1) != 1:
        query = query.contiguous()
    if block_tables.stride(-1) != 1:  # the kernel reads a row's entries as consecutive ints
        block_tables = block_tables.contiguous()
    plan = split_plan(q_len, kv_len, b, hq, hkv, d, query.dtype, sm_count(query.device), split_len=split_len,
                      block_m=block_m, block_n=block_n)
    out = torch.empty(b, q_len, hq, d, dtype=query.dtype, device=query.device).transpose(1, 2)
    if b == 0 or q_len == 0:
        return out
    rows = group * q_len
    mid_o = torch.empty(b * hkv, plan.n_splits, rows, d, dtype=torch.float32, device=query.device)
    mid_l = torch.empty(b * hkv, plan.n_splits, rows, dtype=torch.float32, device=query.device)
    _paged_split_kernel[(plan.row_tiles, plan.n_splits, b * hkv)](
        query, key_cache, value_cache, block_tables, mid_o, mid_l, lengths,
        query.stride(0), query.stride(1), query.stride(2),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_l.stride(0), mid_l.stride(1),
        hkv, q_len, kv_len, plan.split_len, scale * LOG2E,
        HEAD_DIM=d, D_PAD=padded_head_dim(d), GROUP=group, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n,
        BLOCK_SIZE=block_size, IEEE=query.dtype == torch.float32, DOT_F32=dot_in_fp32(query.dtype),
        num_warps=plan.num_warps, num_stages=plan.num_stages,
    )
    reduce_splits(mid_o, mid_l, out, lengths, kv_heads=hkv, kv_len=kv_len, plan=plan)
    return out
