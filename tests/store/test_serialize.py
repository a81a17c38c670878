"""Wire format: round trips, and every kind of damage is a typed error, never a wrong record."""
from __future__ import annotations

import pytest
import torch
from _synth import same

from kvboost.store.quant import QuantCodec
from kvboost.store.serialize import (
    FRAME_SIZE,
    CorruptRecordError,
    NamespaceMismatchError,
    RecordError,
    dumps,
    loads,
    loads_meta,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_lossless_round_trip(record_factory, dtype):
    rec = record_factory(1, dtype=dtype, parent_key="parent", start=32)
    assert same(loads(dumps(rec, "ns"), "ns", rec.key), rec)


def test_root_chunk_and_sliced_views(record_factory):
    rec = record_factory(2)
    whole = torch.randn(2, 64, 16)
    rec.keys[0] = whole[:, 16:32]  # a view into a longer cache, as the engine slices them
    out = loads(dumps(rec, "ns"))
    assert out.parent_key is None and torch.equal(out.keys[0], whole[:, 16:32])


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_blob_is_smaller_and_decodes(record_factory, bits):
    rec = record_factory(3, tokens=128, head_dim=64, dtype=torch.float16)
    raw, packed = dumps(rec, "ns"), dumps(rec, "ns", QuantCodec(bits))
    assert len(packed) < len(raw) * (0.55 if bits == 8 else 0.31)
    out = loads(packed, "ns")
    assert out.keys[0].dtype == torch.float16 and out.meta() == rec.meta()
    assert loads_meta(packed, "ns") == rec.meta()


def test_namespace_and_key_checked(record_factory):
    blob = dumps(record_factory(4), "model-a")
    with pytest.raises(NamespaceMismatchError):
        loads(blob, "model-b")
    with pytest.raises(NamespaceMismatchError):
        loads(blob, "model-a", key="another-key")


def test_every_truncation_and_bit_flip_is_detected(record_factory):
    blob = dumps(record_factory(5, layers=2, tokens=8, head_dim=8), "ns", QuantCodec(4))
    for n in [0, 1, FRAME_SIZE - 1, FRAME_SIZE, FRAME_SIZE + 10, len(blob) // 2, len(blob) - 1]:
        with pytest.raises(CorruptRecordError):
            loads(blob[:n], "ns")
    with pytest.raises(CorruptRecordError):
        loads(blob + b"\0", "ns")
    for pos in range(0, len(blob), max(1, len(blob) // 200)):
        damaged = bytearray(blob)
        damaged[pos] ^= 0x10
        with pytest.raises(RecordError):
            loads(bytes(damaged), "ns")
