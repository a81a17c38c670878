"""Attention through a block table: the Triton paged kernel (interpreted on CPU) against a float64 reference, and
the torch gather path against the contiguous SDPA path (bit for bit).

Tables are shuffled (a row's blocks are not consecutive, rows interleave), rows have different lengths, the last
block of a row is partly filled, and everything the kernel must not read (blocks no row lists, slots past a row's
length) is NaN: NaN spreads through any matmul that touches it.
"""
from __future__ import annotations

import pytest
import torch

from kvboost.kv.block_table import BlockTable, stack_tables
from kvboost.kv.blocks import BlockLayout, BlockPool
from kvboost.model.attention.reference import reference_attention, sdpa_attention

TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=3e-3, rtol=3e-3),
       torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _paged_inputs(lengths: list[int], hq: int, hkv: int, q: int, d: int, bs: int, dtype: torch.dtype,
                  device: torch.device, *, poison: float = float("nan"), seed: int = 0):
    """(query, key_cache, value_cache, tables [B, W] int32, lengths [B], contiguous K, V [B, Hkv, W * bs, d]).

    Blocks are dealt to rows in a shuffled order with spare blocks between them; cache entries no row may read
    hold `poison`; the contiguous K/V (built entry by entry, not by the code under test) hold zeros there."""
    g = torch.Generator().manual_seed(seed)
    b = len(lengths)
    width = max(1, max(-(-n // bs) for n in lengths))
    n_blocks = b * width + 3
    order = torch.randperm(n_blocks, generator=g).tolist()
    tables = torch.zeros(b, width, dtype=torch.int32)
    kc = torch.full((n_blocks, hkv, bs, d), poison)
    vc = torch.full((n_blocks, hkv, bs, d), poison)
    k_flat = torch.zeros(b, hkv, width * bs, d)
    v_flat = torch.zeros(b, hkv, width * bs, d)
    for row, n in enumerate(lengths):
        for j in range(-(-n // bs)):
            blk = order.pop()
            tables[row, j] = blk
            used = min(bs, n - j * bs)
            k, v = torch.randn(2, hkv, used, d, generator=g)
            kc[blk, :, :used], vc[blk, :, :used] = k, v
            k_flat[row, :, j * bs:j * bs + used], v_flat[row, :, j * bs:j * bs + used] = k, v
    query = torch.randn(b, hq, q, d, generator=g)
    to = dict(device=device, dtype=dtype)
    return (query.to(**to), kc.to(**to), vc.to(**to), tables.to(device),
            torch.tensor(lengths, dtype=torch.int32, device=device), k_flat.to(**to), v_flat.to(**to))


def _kernel(query, kc, vc, tables, lengths, **kw):
    from kvboost.model.attention.paged import paged_attention_triton

    return paged_attention_triton(query, kc, vc, tables, lengths, **{"split_len": 32, "block_n": 16, **kw})


def _check(out, query, k, v, lengths, scale):
    ref = reference_attention(query, k, v, scale=scale, ends=lengths)
    assert out.shape == query.shape and out.dtype == query.dtype
    torch.testing.assert_close(out.double(), ref, **TOL[query.dtype])


# ---- the Triton kernel ------------------------------------------------------------------------------------
@pytest.mark.parametrize("d", [64, 80, 96, 128, 256])
def test_paged_head_dims(kernel_device, d):
    query, kc, vc, tables, lengths, k, v = _paged_inputs([45, 13], 3, 1, 1, d, 16, torch.float32, kernel_device)
    _check(_kernel(query, kc, vc, tables, lengths, scale=d ** -0.5), query, k, v, lengths, d ** -0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv", [(2, 2), (2, 1), (3, 1), (4, 1), (8, 2)])
def test_paged_gqa_and_dtypes(kernel_device, dtype, hq, hkv):
    query, kc, vc, tables, lengths, k, v = _paged_inputs([70, 33], hq, hkv, 2, 64, 16, dtype, kernel_device,
                                                         seed=hq * 10 + hkv)
    _check(_kernel(query, kc, vc, tables, lengths, scale=0.11), query, k, v, lengths, 0.11)


@pytest.mark.parametrize("bs", [8, 16, 32])
def test_paged_query_block_over_cache_any_block_size(kernel_device, bs):
    # 4 heads x 17 queries = 68 folded rows in row tiles of 32 (each with its own causal bound) over splits of
    # 32 keys; a 16-key tile spans two blocks of 8, or half a block of 32. Row 1 has fewer keys than queries:
    # its first queries see nothing and return 0.
    query, kc, vc, tables, lengths, k, v = _paged_inputs([83, 9, 64], 4, 1, 17, 64, bs, torch.float16,
                                                         kernel_device, seed=bs)
    out = _kernel(query, kc, vc, tables, lengths, scale=0.1, block_m=32)
    _check(out, query, k, v, lengths, 0.1)
    assert out[1, :, :8].abs().max() == 0


def test_paged_ragged_rows_and_empty_row(kernel_device):
    query, kc, vc, tables, lengths, k, v = _paged_inputs([100, 1, 0, 48], 4, 2, 1, 128, 16, torch.float32,
                                                         kernel_device, seed=3)
    out = _kernel(query, kc, vc, tables, lengths, scale=0.09)
    _check(out, query, k, v, lengths, 0.09)
    assert out[2].abs().max() == 0  # a row with no key attends to nothing: zeros, not NaN


def test_paged_kernel_matches_contiguous_split_kernel(kernel_device):
    """Same plan, same tiles, same arithmetic: the paged kernel's output equals decode.py's over the same K/V."""
    from kvboost.model.attention.decode import decode_attention

    query, kc, vc, tables, lengths, k, v = _paged_inputs([90, 47], 4, 2, 3, 64, 16, torch.float16,
                                                         kernel_device, seed=4)
    paged = _kernel(query, kc, vc, tables, lengths, scale=0.1)
    flat = decode_attention(query, k, v, scale=0.1, ends=lengths, split_len=32, block_n=16)
    assert torch.equal(paged, flat)


def test_paged_kernel_reads_a_block_pool(kernel_device):
    """The pool's per-layer views (strided: [N, layers, 2, H, bs, d] sliced) feed the kernel as they are."""
    pool = BlockPool(BlockLayout(2, 2, 64, 16, torch.float32), 12, device=kernel_device)
    g = torch.Generator().manual_seed(5)
    tables, flat = [], []
    for n in (37, 20):
        pool.allocate(1)  # another sequence's block between this one's
        table = BlockTable(pool)
        table.reserve(n)
        kv = torch.randn(2, 2, 2, n, 64, generator=g).to(kernel_device)  # [layer, K/V, H, n, d]
        for layer in range(2):
            table.write(layer, 0, kv[layer, 0], kv[layer, 1])
        tables.append(table)
        flat.append(kv[1])
    ids, lengths = stack_tables(tables, kernel_device)
    query = torch.randn(2, 4, 1, 64, generator=g).to(kernel_device)
    out = _kernel(query, pool.keys(1), pool.values(1), ids, lengths, scale=0.125)
    for row in range(2):
        n = tables[row].length
        ref = reference_attention(query[row:row + 1], flat[row][0][None], flat[row][1][None], scale=0.125)
        torch.testing.assert_close(out[row:row + 1].double(), ref, **TOL[torch.float32])
        assert n == flat[row].shape[2]


# ---- the torch gather path ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,hq,hkv,q", [(torch.float32, 4, 1, 1), (torch.bfloat16, 3, 1, 5),
                                            (torch.float16, 2, 2, 12)])
def test_gather_path_equals_contiguous_sdpa(dtype, hq, hkv, q):
    from kvboost.model.attention.paged_backend import paged_attention_gather

    # Garbage in unread entries is finite here: SDPA masks by adding -inf, and NaN + -inf is still NaN.
    query, kc, vc, tables, lengths, k, v = _paged_inputs([40, 11, 29], hq, hkv, q, 64, 8, dtype,
                                                         torch.device("cpu"), poison=7.0, seed=q)
    for kv_len in (None, 40):  # the tables' capacity, or just the longest row
        out = paged_attention_gather(query, kc, vc, tables, lengths, scale=0.1, kv_len=kv_len)
        cols = k.shape[2] if kv_len is None else kv_len
        flat = sdpa_attention(query, k[:, :, :cols], v[:, :, :cols], scale=0.1, ends=lengths)
        assert torch.equal(out, flat)


def test_dispatch_and_refusals(kernel_device):
    from kvboost.model.attention.paged_backend import paged_dispatch
    from kvboost.model.attention.support import KernelUnsupportedError

    query, kc, vc, tables, lengths, k, v = _paged_inputs([20, 5], 2, 1, 1, 64, 8, torch.float32, kernel_device,
                                                         poison=0.0)
    out, used, _ = paged_dispatch(query, kc, vc, tables, lengths, scale=0.1, backend="triton")
    assert used == "triton"
    _check(out, query, k, v, lengths, 0.1)
    out_sdpa, used, _ = paged_dispatch(query, kc, vc, tables, lengths, scale=0.1, backend="sdpa")
    assert used == "sdpa"
    torch.testing.assert_close(out_sdpa, out, **TOL[torch.float32])
    with pytest.raises(KernelUnsupportedError, match="lengths"):
        paged_dispatch(query, kc, vc, tables, lengths[:1], scale=0.1, backend="triton")
    with pytest.raises(KernelUnsupportedError, match="multiple"):
        paged_dispatch(query[:, :1].expand(2, 3, 1, 64), kc.expand(-1, 2, -1, -1), vc.expand(-1, 2, -1, -1),
                       tables, lengths, scale=0.1, backend="triton")


# ---- the CPU in-place path -------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,hq,hkv,q", [(torch.float32, 4, 1, 1), (torch.float32, 9, 3, 13),
                                            (torch.bfloat16, 3, 1, 5), (torch.float16, 2, 2, 12)])
def test_in_place_path_matches_the_reference_without_reading_past_a_row(dtype, hq, hkv, q):
    """Shuffled tables (runs of one block), rows ending mid-block, NaN in every entry a row may not read: the
    in-place path reads only what each row's length allows, and is what paged_dispatch runs on a CPU."""
    from kvboost.model.attention.paged_backend import in_place_refusal, paged_attention_in_place, paged_dispatch

    query, kc, vc, tables, lengths, k, v = _paged_inputs([40, 13, 29], hq, hkv, q, 64, 8, dtype,
                                                         torch.device("cpu"), seed=q)
    assert in_place_refusal(query, kc, vc, tables, lengths) is None
    out = paged_attention_in_place(query, kc, vc, tables, lengths, scale=0.1)
    _check(out, query, k, v, lengths, 0.1)
    dispatched, used, _ = paged_dispatch(query, kc, vc, tables, lengths, scale=0.1)
    assert used == "sdpa" and torch.equal(dispatched, out)


def test_in_place_path_reads_runs_of_blocks_as_strided_views():
    """A pool's per-layer views, tables whose blocks run consecutively or evenly spaced (another sequence's blocks
    between them): one call per run, same result as the reference."""
    from kvboost.model.attention.paged_backend import _even_runs, paged_attention_in_place

    g = torch.Generator().manual_seed(9)
    pool = BlockPool(BlockLayout(2, 2, 32, 8, torch.float32), 40)
    storage = torch.randn(pool.storage.shape, generator=g)
    pool.storage.copy_(storage)
    ids = [[3, 4, 5, 6, 7, 20], [10, 12, 14, 16, 2, 30]]
    assert [len(_even_runs(row[:5])) for row in ids] == [1, 2]
    tables = torch.tensor(ids, dtype=torch.int32)
    lengths = torch.tensor([45, 37], dtype=torch.int32)
    query = torch.randn(2, 4, 3, 32, generator=g)
    out = paged_attention_in_place(query, pool.keys(1), pool.values(1), tables, lengths, scale=0.2)
    for row in range(2):
        n = int(lengths[row])
        k = torch.cat([pool.keys(1)[i] for i in ids[row]], dim=1)[None, :, :n]
        v = torch.cat([pool.values(1)[i] for i in ids[row]], dim=1)[None, :, :n]
        ref = reference_attention(query[row:row + 1], k, v, scale=0.2)
        torch.testing.assert_close(out[row:row + 1].double(), ref, **TOL[torch.float32])


def test_in_place_path_refuses_rows_whose_queries_see_no_key():
    from kvboost.model.attention.paged_backend import in_place_refusal, paged_dispatch

    query, kc, vc, tables, lengths, k, v = _paged_inputs([40, 3], 2, 1, 5, 64, 8, torch.float32,
                                                         torch.device("cpu"), poison=7.0)
    assert "see no key" in in_place_refusal(query, kc, vc, tables, lengths)
    out, _, _ = paged_dispatch(query, kc, vc, tables, lengths, scale=0.1, backend="sdpa")  # the gather instead
    assert torch.equal(out, sdpa_attention(query, k, v, scale=0.1, ends=lengths))
