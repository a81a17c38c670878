"""Attention through a block table: the Triton paged kernel (paged.py) where it runs, torch paths elsewhere.

On a CPU, paged_attention_in_place reads the blocks where they lie (torch's CPU flash attention per run of blocks,
merged by log-sum-exp). Elsewhere without the kernel (and where that path refuses), the gather path copies each
row's blocks into contiguous K/V [B, Hkv, kv, d] and runs the SDPA fallback (reference.sdpa_attention) with per-row
lengths: its output is exactly what the contiguous path computes over a workspace holding the same K/V in the
same columns, bit for bit.

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


# torch's CPU flash attention, which also returns each row's log-sum-exp: attention computed per piece of the keys
# merges exactly (softmax over the pieces' log-sum-exps). Private to torch: missing or failing, the gather runs.
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_IN_PLACE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def in_place_refusal(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     block_tables: torch.Tensor, lengths: torch.Tensor) -> str | None:
    """Why paged_attention_in_place cannot take these inputs (None: it can)."""
    if _FLASH_CPU is None:
        return "this torch has no CPU flash attention"
    if query.device.type != "cpu" or query.dtype not in _IN_PLACE_DTYPES or key_cache.dtype != query.dtype:
        return f"{query.device.type} {query.dtype}: the in-place path is the CPU's, for fp32 / bf16 / fp16"
    if key_cache.shape[-1] != value_cache.shape[-1] or query.shape[1] % key_cache.shape[1]:
        return "key and value head dims differ, or query heads are not a multiple of kv heads"
    capacity = block_tables.shape[1] * key_cache.shape[2]
    if any(not query.shape[2] <= min(int(n), capacity) for n in lengths.tolist()):
        return "a row whose queries would see no key"
    return None


def paged_attention_in_place(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                             block_tables: torch.Tensor, lengths: torch.Tensor, *, scale: float) -> torch.Tensor:
    """The CPU path without a gather (see in_place_refusal for what it takes): per row, the keys every query sees
    (whole blocks before the row's last q positions) are read where they lie, one flash-attention call per run of
    evenly spaced block ids (a strided view of the pool: the blocks are the call's batch, each query attends each
    block's keys), and the rest (the last partial block and the queries' own positions, bottom-right causal) from
    a small copy; the pieces merge by their log-sum-exps. GQA folds each kv head's query heads into the query
    axis (no repeated K/V). Same semantics as the gather path up to float rounding (merging reorders the sums).

    Measured (`OMP_NUM_THREADS=1 python scripts/table_attention_ab.py`: SmolLM2-135M fp32, a question over a 2k / 7k
    stored prefix, `paged_attention="table"`): TTFT 89.6 / 151.4 ms against the gather's 96.6 / 185.1 and 89.1 /
    161.1 with the prefix resident in the unpaged workspace; decode steps 47.4 / 73.0 against 47.5 / 75.4 and
    44.1 / 69.4."""
    b, hq, q, d = query.shape
    hkv, bs = key_cache.shape[1], key_cache.shape[2]
    group = hq // hkv
    capacity = block_tables.shape[1] * bs
    out = torch.empty_like(query)
    for row, (end, ids) in enumerate(zip(lengths.tolist(), block_tables.tolist())):
        end = min(int(end), capacity)
        queries = query[row].reshape(hkv, group * q, d)  # rows (query head in its group, query position)
        whole = (end - q) // bs  # blocks every query sees whole
        outs, lses = [], []
        for first, step, n in _even_runs(ids[:whole]):
            keys = key_cache[first:first + step * (n - 1) + 1:step]  # [n, Hkv, bs, d], a view
            values = value_cache[first:first + step * (n - 1) + 1:step]
            o, lse = _FLASH_CPU(queries.expand(n, -1, -1, -1), keys, values, scale=scale)[:2]
            outs.append(o)
            lses.append(lse)
        start, tail_blocks = whole * bs, ids[whole:-(-end // bs)]
        t = end - start
        if q == 1:  # a decode step: its one block, every key visible to the one query - a view, no mask
            keys, values = key_cache[tail_blocks[0]][None, :, :t], value_cache[tail_blocks[0]][None, :, :t]
            o, lse = _FLASH_CPU(queries[None], keys, values, scale=scale)[:2]
        else:
            keys = torch.cat([key_cache[i] for i in tail_blocks], dim=1)[None, :, :t]  # [1, Hkv, t, d]
            values = torch.cat([value_cache[i] for i in tail_blocks], dim=1)[None, :, :t]
            hidden = torch.arange(t)[None, :] > torch.arange(t - q, t)[:, None]  # [q, t] bottom-right causal
            bias = torch.zeros(q, t, dtype=query.dtype).masked_fill_(hidden, float("-inf")).repeat(group, 1)
            o, lse = _FLASH_CPU(queries[None], keys, values, attn_mask=bias[None, None].expand(1, hkv, -1, -1),
                                scale=scale)[:2]
        outs.append(o)
        lses.append(lse)
        weights = torch.softmax(torch.cat(lses), dim=0)  # [pieces, Hkv, group * q]
        merged = (weights[..., None] * torch.cat(outs).float()).sum(0)  # [Hkv, group * q, d]
        out[row] = merged.reshape(hq, q, d).to(query.dtype)
    return out


def _even_runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """(first id, step, count) of each run of ids in arithmetic progression with a positive step: [4, 5, 6, 9, 11,
    13, 2] -> [(4, 1, 3), (9, 2, 3), (2, 1, 1)]."""
    runs: list[tuple[int, int, int]] = []
    j = 0
    while j < len(ids):
        n, step = 1, ids[j + 1] - ids[j] if j + 1 < len(ids) else 1
        if step <= 0:
            step = 1
        else:
            while j + n < len(ids) and ids[j + n] - ids[j + n - 1] == step:
                n += 1
        runs.append((ids[j], step, n))
        j += n
    return runs


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
    if in_place_refusal(query, key_cache, value_cache, block_tables, lengths) is None:
        try:
            out = paged_attention_in_place(query, key_cache, value_cache, block_tables, lengths, scale=scale)
            return out, "sdpa", why
        except RuntimeError:  # torch's private op changed under us: the gather computes the same
            pass
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
