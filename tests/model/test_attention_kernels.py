"""The Triton kernels against a float64 reference: every GQA ratio, head dim, causal offset, partial tile, dtype.

On CPU they run in triton's interpreter (tests/model/conftest.py sets TRITON_INTERPRET=1), which is slow: shapes
are tiny, tiles are 16 wide so that q and kv still span several (partial) tiles, heads are few.
"""
from __future__ import annotations

import pytest
import torch

from kvboost.model.attention.reference import reference_attention

TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=3e-3, rtol=3e-3),
       torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _qkv(b, hq, hkv, q, kv, d, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    return make(b, hq, q, d), make(b, hkv, kv, d), make(b, hkv, kv, d)


def _check(out, query, key, value, **kw):
    ref = reference_attention(query, key, value, **kw)
    assert out.shape == query.shape and out.dtype == query.dtype
    torch.testing.assert_close(out.double(), ref, **TOL[query.dtype])


def _prefill(query, key, value, **kw):
    from kvboost.model.attention.prefill import prefill_attention

    return prefill_attention(query, key, value, block_m=16, block_n=16, **kw)


# ---- prefill -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("d", [64, 80, 96, 128, 256])
def test_prefill_head_dims(kernel_device, d):
    # GQA 3, q = 19 and kv = 45: partial query and key tiles, a cached prefix of 26 (past > 0).
    query, key, value = _qkv(1, 3, 1, 19, 45, d, torch.float32, kernel_device)
    _check(_prefill(query, key, value, scale=d ** -0.5), query, key, value, scale=d ** -0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv", [(2, 2), (3, 1), (4, 1)])
def test_prefill_gqa_and_dtypes(kernel_device, dtype, hq, hkv):
    query, key, value = _qkv(1, hq, hkv, 17, 40, 64, dtype, kernel_device, seed=hq)
    _check(_prefill(query, key, value, scale=0.11), query, key, value, scale=0.11)


@pytest.mark.parametrize("q,kv,kv_len", [
    (21, 21, None),   # past = 0: plain causal prefill, q == kv
    (16, 48, None),   # q and kv multiples of the tile: the unmasked full-tile path ends exactly on a boundary
    (5, 60, 37),      # a workspace longer than its valid length: only the first 37 keys may be read
    (30, 30, 12),     # more queries than valid keys: the first 18 queries see nothing and return 0
])
def test_prefill_causal_offsets(kernel_device, q, kv, kv_len):
    query, key, value = _qkv(1, 2, 1, q, kv, 64, torch.float32, kernel_device)
    if kv_len is not None:  # poison what must not be read: NaN would spread through any matmul that touches it
        key[:, :, kv_len:] = float("nan")
        value[:, :, kv_len:] = float("nan")
    out = _prefill(query, key, value, scale=0.125, kv_len=kv_len)
    key, value = key[:, :, : kv_len or kv], value[:, :, : kv_len or kv]
    _check(out, query, key, value, scale=0.125)


def test_prefill_ragged_rows_and_padding(kernel_device):
    query, key, value = _qkv(3, 4, 2, 9, 50, 96, torch.float16, kernel_device)
    ends = torch.tensor([50, 23, 6], device=kernel_device)  # row 2 is shorter than the query block
    _check(_prefill(query, key, value, scale=0.1, ends=ends), query, key, value, scale=0.1, ends=ends)
    valid = torch.ones(3, 50, dtype=torch.bool, device=kernel_device)
    valid[0, :7] = False  # left padding
    valid[1, 20:30] = False  # a hole
    _check(_prefill(query, key, value, scale=0.1, key_valid=valid), query, key, value, scale=0.1, key_valid=valid)


def test_prefill_reads_strided_views(kernel_device):
    # transformers hands query as a transpose of [B, q, H, d]; the workspace hands key/value as column slices.
    q_bshd = torch.randn(1, 13, 4, 80, device=kernel_device)
    k_buf, v_buf = torch.randn(2, 1, 2, 64, 80, device=kernel_device).unbind(0)
    query, key, value = q_bshd.transpose(1, 2), k_buf[:, :, :33], v_buf[:, :, :33]
    out = _prefill(query, key, value, scale=0.1)
    _check(out, query, key, value, scale=0.1)
    assert out.transpose(1, 2).is_contiguous()  # transformers' reshape after transpose(1, 2) copies nothing


# ---- decode --------------------------------------------------------------------------------------------------
def _decode(query, key, value, **kw):
    from kvboost.model.attention.decode import decode_attention

    return decode_attention(query, key, value, **{"split_len": 128, "block_n": 64, **kw})


@pytest.mark.parametrize("dtype,hq,hkv,q", [(torch.float32, 4, 1, 1), (torch.bfloat16, 2, 2, 1),
                                            (torch.float16, 3, 1, 3)])
def test_decode_split_k_long_cache(kernel_device, dtype, hq, hkv, q):
    # 700 keys in splits of 128: 6 splits, the last one partial; a short draft (q = 3) stays causal.
    query, key, value = _qkv(1, hq, hkv, q, 700, 64, dtype, kernel_device)
    _check(_decode(query, key, value, scale=0.125), query, key, value, scale=0.125)


def test_decode_ragged_rows(kernel_device):
    query, key, value = _qkv(3, 4, 1, 1, 700, 128, torch.float32, kernel_device)
    ends = torch.tensor([700, 129, 0], device=kernel_device)  # row 1 ends one key into a split; row 2 is empty
    valid = torch.rand(3, 700, generator=torch.Generator().manual_seed(1)).to(kernel_device) > 0.25
    out = _decode(query, key, value, scale=0.09, ends=ends, key_valid=valid)
    _check(out, query, key, value, scale=0.09, ends=ends, key_valid=valid)
    assert out[2].abs().max() == 0  # a row with no key attends to nothing: zeros, not NaN


def test_split_kernel_takes_any_query_block(kernel_device):
    # 8 heads x 17 queries = 136 folded rows: several row tiles of 32, each with its own causal bound, over
    # splits of 32 keys; the cache tail past kv_len is poisoned and must not be read.
    query, key, value = _qkv(1, 8, 1, 17, 120, 64, torch.float16, kernel_device)
    key[:, :, 100:], value[:, :, 100:] = float("nan"), float("nan")
    out = _decode(query, key, value, scale=0.1, kv_len=100, split_len=32, block_m=32, block_n=16)
    _check(out, query, key[:, :, :100], value[:, :, :100], scale=0.1)


def test_split_kernel_causal_prefill_and_padding(kernel_device):
    # q == kv (plain causal prefill): splits above a row tile's diagonal skip all work; GQA 3 does not divide
    # the row tile, so a query's heads straddle two tiles; a padding vector masks every tile.
    query, key, value = _qkv(2, 3, 1, 24, 24, 80, torch.float32, kernel_device)
    _check(_decode(query, key, value, scale=0.1, split_len=16, block_m=16, block_n=16), query, key, value, scale=0.1)
    valid = torch.rand(2, 24, generator=torch.Generator().manual_seed(2)).to(kernel_device) > 0.3
    out = _decode(query, key, value, scale=0.1, key_valid=valid, split_len=16, block_m=16, block_n=16)
    _check(out, query, key, value, scale=0.1, key_valid=valid)


class _NoSyncEnds(torch.Tensor):
    """A device `ends` that raises on every host read of its values (or of a tensor computed from it)."""

    SYNCS = {"item", "tolist", "numpy", "cpu", "nonzero", "__bool__", "__int__", "__float__", "__index__"}

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in cls.SYNCS:
            raise AssertionError(f"host read of ends: {func.__name__}")
        return super().__torch_function__(func, types, args, kwargs or {})


def test_split_kernel_same_capacity_any_ends_no_sync(kernel_device, monkeypatch):
    """Graph safety: one capacity, several `ends`: the same launches (grid, split count, scratch shapes), no host
    read of the ends, never a key at or past a row's end (the stale tail is NaN), empty splits merge to 0."""
    from kvboost.model.attention import decode, prefill

    grids, empties = [], []
    real_split, real_empty = decode._split_kernel, torch.empty

    class _Recorder:
        def __getitem__(self, grid):
            grids.append(grid)
            return real_split[grid]

    monkeypatch.setattr(decode, "_split_kernel", _Recorder())
    monkeypatch.setattr(decode.torch, "empty", lambda *a, **k: empties.append(a) or real_empty(*a, **k))
    query, key, value = _qkv(3, 4, 2, 5, 96, 64, torch.float32, kernel_device)
    for ends in ([96, 40, 0], [3, 96, 33], [64, 17, 2]):
        ends_t = torch.tensor(ends, dtype=torch.int32, device=kernel_device)
        k, v = key.clone(), value.clone()
        for row, end in enumerate(ends):
            k[row, :, end:], v[row, :, end:] = float("nan"), float("nan")
        out = _decode(query, k, v, scale=0.1, ends=ends_t.as_subclass(_NoSyncEnds), split_len=32, block_n=16)
        _check(out.as_subclass(torch.Tensor), query, key, value, scale=0.1, ends=ends_t)
        out = prefill.prefill_attention(query, k, v, scale=0.1, ends=ends_t.as_subclass(_NoSyncEnds),
                                        block_m=16, block_n=16)
        _check(out.as_subclass(torch.Tensor), query, key, value, scale=0.1, ends=ends_t)
    assert len(grids) == 3 and len(set(grids)) == 1
    # Per ends: split out, partials, lse; prefill out (the same shape as split's). Identical for every ends.
    assert len(empties) == 12 and len(set(map(str, empties))) == 3
    with pytest.raises(AssertionError, match="host read"):  # the guard itself works
        ends_t.as_subclass(_NoSyncEnds).max().item()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and sync debug mode need CUDA")
def test_kernels_capture_in_a_cuda_graph(kernel_device):
    from kvboost.model.attention.backend import run_kernel

    query, key, value = _qkv(2, 16, 2, 32, 3000, 128, torch.bfloat16, kernel_device)
    ends = torch.tensor([3000, 3000], dtype=torch.int32, device=kernel_device)
    for q_len in (1, 32):  # decode, and a short block over a long cache (split-K with several row tiles)
        def call(block=query[:, :, :q_len]):
            return run_kernel(block, key, value, scale=0.1, kv_len=3000, ends=ends, key_valid=None)

        torch.cuda.set_sync_debug_mode("error")
        try:
            call()  # compile outside the capture; then no sync
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                call()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = call()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        for new in ([3000, 1234], [77, 2999], [q_len, 1]):
            ends.copy_(torch.tensor(new))
            graph.replay()
            _check(out, query[:, :, :q_len], key, value, scale=0.1, ends=ends)


# ---- dispatch --------------------------------------------------------------------------------------------------
def test_dispatch_routes_to_both_kernels(kernel_device, monkeypatch):
    from kvboost.model.attention import backend

    query, key, value = _qkv(1, 2, 1, 1, 90, 80, torch.float32, kernel_device)
    out, used, _ = backend.dispatch(query, key, value, past=60, scale=0.1, backend="triton")  # decode route
    assert used == "triton"
    _check(out, query, key[:, :, :61], value[:, :, :61], scale=0.1)
    monkeypatch.setattr(backend, "DECODE_MAX_ROWS", 0)  # force the prefill route on a small shape
    query = _qkv(1, 2, 1, 20, 1, 80, torch.float32, kernel_device, seed=3)[0]
    out, used, _ = backend.dispatch(query, key, value, scale=0.1, backend="triton")
    assert used == "triton"
    _check(out, query, key, value, scale=0.1)


def test_dispatch_rule_splits_long_caches_only():
    """Shapes only (no kernel runs): a short block over a long cache splits the keys, causal prefill does not."""
    pytest.importorskip("triton")
    from kvboost.model.attention.backend import use_split_kernel
    from kvboost.model.attention.decode import split_plan

    rule = lambda q, kv, b=1, hq=16, hkv=2: use_split_kernel(q, kv, b, hq, hkv, 128, torch.bfloat16, 132)  # noqa: E731
    assert rule(1, 1541) and rule(32, 30_032) and rule(40, 1540) and rule(256, 16_384) and rule(512, 1540)
    assert not rule(2048, 2048) and not rule(512, 512) and not rule(1024, 32_768, b=2) and not rule(40, 100)
    plan = split_plan(32, 30_032, 1, 16, 2, 128, torch.bfloat16, 132)
    assert 100 <= plan.row_tiles * plan.n_splits * 2 <= 132  # about one full wave of programs, never a second
