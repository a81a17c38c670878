"""KIVI codec: round trips, exact byte accounting, the byte-ratio targets and the error bound."""
from __future__ import annotations

import pytest
import torch

from kvboost.store.memory import MemoryStore
from kvboost.store.quant import (
    QuantCodec,
    QuantRecord,
    QuantTensor,
    dequantize_tensor,
    pack_int4,
    quantize_tensor,
    unpack_int4,
)


def _group_scale(q: QuantTensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Each element's group scale, laid out like the original tensor."""
    s = q.scale.float().repeat_interleave(q.group_size, dim=-1)[..., :shape[q.axis]]
    return s.movedim(-1, q.axis)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("axis", [0, 1, 2])
@pytest.mark.parametrize("group_size", [1, 7, 16, 128])
def test_error_bound_half_a_step(bits, axis, group_size):
    g = torch.Generator().manual_seed(bits * 100 + axis * 10 + group_size)
    # Offsets and per-channel magnitudes like real keys: some groups far from zero, some wide.
    x = torch.randn(3, 37, 24, generator=g) * torch.linspace(0.01, 20, 24) + torch.linspace(-5, 30, 24)
    q = quantize_tensor(x, bits, group_size, axis=axis)
    y = dequantize_tensor(q)
    assert y.shape == x.shape and y.dtype == x.dtype
    bound = _group_scale(q, x.shape) / 2
    assert ((x - y).abs() <= bound * (1 + 1e-3) + x.abs() * 1e-6).all()  # + fp32 rounding of q*s+z
    # and the scale really is a 1/(2^bits - 1) slice of each group's range (up to fp16 rounding)
    assert q.scale.float().max() <= (x.max() - x.min()) / ((1 << bits) - 1) * 1.01 + 1e-6


# RMS error of rounding is step/sqrt(12), step = (range of 128 gaussians ~5.2) / (2^bits - 1)
@pytest.mark.parametrize("bits,rel_rms", [(8, 0.007), (4, 0.12)])
def test_relative_error_on_gaussian_kv(bits, rel_rms):
    x = torch.randn(4, 128, 64, generator=torch.Generator().manual_seed(1))
    y = dequantize_tensor(quantize_tensor(x, bits, 128, axis=1))
    assert ((x - y).pow(2).mean().sqrt() / x.pow(2).mean().sqrt()) < rel_rms


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dtype_preserved_and_constant_groups_exact(dtype):
    x = torch.full((2, 16, 8), 3.25, dtype=dtype)
    for bits in (8, 4):
        y = dequantize_tensor(quantize_tensor(x, bits, 16, axis=1))
        assert y.dtype == dtype and torch.equal(y, x)


@pytest.mark.parametrize("n", [1, 2, 15, 16, 33])
def test_int4_pack_unpack(n):
    codes = torch.randint(0, 16, (n,), dtype=torch.uint8)
    packed = pack_int4(codes)
    assert packed.numel() == (n + 1) // 2
    assert torch.equal(unpack_int4(packed, n), codes)


@pytest.mark.parametrize("heads", [2, 3, 4, 8])
def test_byte_ratio_targets(record_factory, heads):
    rec = record_factory(0, layers=4, heads=heads, tokens=128, head_dim=64, dtype=torch.float32)
    ratios = {}
    for bits in (8, 4):
        payload = QuantCodec(bits).encode(rec)
        # exact accounting: packed codes + fp16 scales + fp16 minimums, nothing hidden
        parts = sum(t.data.numel() + 2 * t.scale.numel() + 2 * t.zero.numel() for t in payload.keys + payload.values)
        assert payload.nbytes == parts
        ratios[bits] = payload.nbytes / (2 * sum(t.numel() for t in rec.keys + rec.values))  # vs fp16
    assert ratios[8] <= 0.52, ratios
    assert ratios[4] <= 0.28, ratios


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tokens,head_dim", [(16, 16), (37, 64), (128, 64)])
def test_codec_round_trip(record_factory, bits, dtype, tokens, head_dim):
    rec = record_factory(3, heads=2, tokens=tokens, head_dim=head_dim, dtype=dtype, parent_key="p")
    codec = QuantCodec(bits)
    payload = codec.encode(rec)
    assert isinstance(payload, QuantRecord)
    out = codec.decode(payload)
    assert out.meta() == rec.meta()
    tol = {8: 0.05, 4: 0.8}[bits]  # randn spans ~[-4, 4]: half a step is 8/255/2 resp. 8/15/2, plus dtype rounding
    for a, b in zip(out.keys + out.values, rec.keys + rec.values):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert (a.float() - b.float()).abs().max() < tol


def test_non_finite_tensor_is_kept_raw(record_factory):
    rec = record_factory(4)
    rec.keys[1][0, 0, 0] = float("inf")
    rec.values[2][1, 3, 5] = float("nan")
    codec = QuantCodec(8)
    payload = codec.encode(rec)
    assert isinstance(payload.keys[0], QuantTensor) and not isinstance(payload.keys[1], QuantTensor)
    out = codec.decode(payload)
    assert torch.equal(out.keys[1], rec.keys[1])
    assert torch.equal(out.values[2].isnan(), rec.values[2].isnan())


def test_memory_store_accounts_quantized_bytes(record_factory):
    codec = QuantCodec(4)
    recs = [record_factory(i, tokens=128, head_dim=64) for i in range(3)]
    budget = sum(codec.encode(r).nbytes for r in recs)
    store = MemoryStore(budget, codec=codec)
    assert all(store.put(r) for r in recs)
    assert store.stats().bytes == budget  # three fit exactly; at fp16 they would need ~3.7x as much
    assert store.put(record_factory(9, tokens=128, head_dim=64))
    assert store.stats().evictions == 1 and store.stats().bytes <= budget
    got = store.get("chunk-9")
    assert got is not None and got.keys[0].dtype == torch.float32
