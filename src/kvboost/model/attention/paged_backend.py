"""Attention through a block table: the Triton paged kernel (paged.py) where it runs, a torch gather path elsewhere.

The gather path copies each row's blocks into contiguous K/V [B, Hkv, kv, d] and runs the SDPA fallback
(reference.sdpa_attention) with per-row lengths: its output is exactly what the contiguous path computes over a
workspace holding the same K/V in the same columns, bit for bit. It is the CPU path (and the path without
triton); on a GPU the kernel reads the blocks where they are.

Nothing here imports triton at module level.
"""
from __future__ import annotations

import torch

from .backend import Backend, select_backend
from .reference import sdpa_attention
from .support import KernelUnsupportedError


def gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor, kv_len: int | None = None) -> torch.Tensor:
    """cache [num_blocks, Hkv, bs, d] and tables [B, W] -> contiguous [B, Hkv, kv_len, d] (default W * bs): row
    b's position p is slot p % bs of block tables[b, p // bs]. Only the blocks covering kv_len are read."""
    bs = cache.shape[2]
    width = block_tables.shape[1] if kv_len is None else -(-int(kv_len) // bs)
    if width > block_tables.shape[1]:
        raise ValueError(f"kv_len {kv_len} needs {width} blocks; the tables have {block_tables.shape[1]}")
    idx = block_tables[:, :width].to(device=cache.device, dtype=torch.long)
    b = idx.shape[0]
    if cache.device.type == "cpu" and width > 0:
        # The blocks' views concatenated straight into the output: one copy. (Indexing, then permuting into token
        # order, copies twice; on a GPU it is two kernels where a per-block list would be a host sync.)
        out = cache.new_empty(b, cache.shape[1], width * bs, cache.shape[3])
        with torch.no_grad():
            for row, blocks in enumerate(idx.tolist()):
                torch.cat([cache[i] for i in blocks], dim=1, out=out[row])
    else:
        out = cache[idx]  # [B, W, Hkv, bs, d]
        out = out.permute(0, 2, 1, 3, 4).reshape(b, cache.shape[1], width * bs, cache.shape[3])
    return out if kv_len is None else out[:, :, :kv_len]


def paged_attention_gather(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, lengths: torch.Tensor, *, scale: float,
                           kv_len: int | None = None) -> torch.Tensor:
    """The torch path: gather, then SDPA with per-row lengths. kv_len (a host int >= every length; default the
    tables' capacity W * bs) is how many columns to gather: pass the longest row's length to read no more."""
    key = gather_blocks(key_cache, block_tables, kv_len)
    value = gather_blocks(value_cache, block_tables, kv_len)
    return sdpa_attention(query, key, value, scale=scale, kv_len=key.shape[2], ends=lengths)


def paged_dispatch(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                   block_tables: torch.Tensor, lengths: torch.Tensor, *, scale: float | None = None,
                   kv_len: int | None = None, backend: str | None = None) -> tuple[torch.Tensor, Backend, str]:
    """`paged_attention()`, also saying which backend ran and why: (out [B, Hq, q, d], backend, reason)."""
    d = query.shape[-1]
    scale = d ** -0.5 if scale is None else float(scale)
    choice, why = select_backend(query.device, query.dtype, d, head_dim_v=value_cache.shape[-1], prefer=backend)
    if choice == "triton":
        from .paged import paged_attention_triton, paged_refusal

        refusal = paged_refusal(query, key_cache, value_cache, block_tables, lengths)
        if refusal is None:
            out = paged_attention_triton(query, key_cache, value_cache, block_tables, lengths, scale=scale)
            return out, "triton", why
        why = refusal
    if backend == "triton":
        raise KernelUnsupportedError(f"triton requested: {why}")
    out = paged_attention_gather(query, key_cache, value_cache, block_tables, lengths, scale=scale, kv_len=kv_len)
    return out, "sdpa", why


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, lengths: torch.Tensor, *, scale: float | None = None,
                    kv_len: int | None = None, backend: str | None = None) -> torch.Tensor:
    """Bottom-right causal attention of query [B, Hq, q, d] over the blocks of each row -> [B, Hq, q, d].

    key_cache / value_cache [num_blocks, Hkv, bs, d]: one layer of the block pool; block_tables [B, W]; lengths
    [B]: row b's valid length (its queries are its last q positions). kv_len: for the gather path, the columns to
    gather (>= every length; default W * bs); the kernel never reads past a row's length anyway.
    backend: None (auto), "triton" (raises KernelUnsupportedError where it cannot run) or "sdpa"."""
    return paged_dispatch(query, key_cache, value_cache, block_tables, lengths, scale=scale, kv_len=kv_len,
                          backend=backend)[0]
