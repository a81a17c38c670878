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

    return decode_attention(query, key, value, split_len=128, block_n=64, **kw)


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


def test_decode_refuses_too_many_folded_rows(kernel_device):
    from kvboost.model.attention.decode import decode_attention
    from kvboost.model.attention.support import KernelUnsupportedError

    query, key, value = _qkv(1, 8, 1, 17, 20, 64, torch.float32, kernel_device)
    with pytest.raises(KernelUnsupportedError, match="folded rows"):
        decode_attention(query, key, value, scale=0.1)


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
