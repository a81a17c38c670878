"""Wire format: round trips, and every kind of damage is a typed error, never a wrong record."""
from __future__ import annotations

import json

import pytest
import torch
from _synth import layered_blob, same

from kvboost.store.base import ChunkMeta, ChunkRecord
from kvboost.store.quant import QuantCodec
from kvboost.store.serialize import (
    FRAME_SIZE,
    CorruptRecordError,
    NamespaceMismatchError,
    RecordError,
    UnsupportedFormatError,
    dumps,
    loads,
    loads_namespaced_meta,
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
    assert loads_namespaced_meta(packed) == ("ns", rec.meta())


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


def _header(blob: bytes) -> dict:
    n = int.from_bytes(blob[FRAME_SIZE:FRAME_SIZE + 8], "little")
    return json.loads(json.loads(blob[FRAME_SIZE + 8:FRAME_SIZE + 8 + n])["__metadata__"]["kvboost"])


def test_full_precision_records_are_written_packed(record_factory):
    rec = record_factory(6, layers=3, heads=2, tokens=5, head_dim=4)
    blob = dumps(rec, "ns")
    assert _header(blob)["format"] == 2 and _header(blob)["layout"] == "packed"
    out = loads(blob, "ns")
    packed = out.packed_view()
    assert packed is not None and packed.shape == (3, 2, 2, 5, 4) and same(out, rec)
    assert torch.equal(packed[1, 0], rec.keys[1]) and torch.equal(packed[2, 1], rec.values[2])
    # A record built packed is written from its pack as it is.
    again = ChunkRecord.from_packed(ChunkMeta(rec.key, None, rec.content_key, rec.token_ids, 0), packed.clone())
    assert dumps(again, "ns") == blob


def test_a_pack_whose_layers_were_replaced_is_not_read(record_factory):
    rec = loads(dumps(record_factory(7), "ns"), "ns")
    assert rec.packed_view() is not None
    rec.keys = [k * 2 for k in rec.keys]
    assert rec.packed_view() is None
    assert torch.equal(loads(dumps(rec, "ns")).keys[0], rec.keys[0])  # stacked from the layers, not the old pack


def test_layers_of_different_shapes_and_quantized_records_stay_per_layer(record_factory):
    rec = record_factory(8, layers=2)
    rec.keys[1], rec.values[1] = rec.keys[1][:1], rec.values[1][:1]  # another kv-head count in layer 1
    blob = dumps(rec, "ns")
    assert _header(blob)["layout"] == "layers" and same(loads(blob, "ns"), rec)
    quantized = dumps(record_factory(9, tokens=32, head_dim=32), "ns", QuantCodec(8))
    assert _header(quantized)["layout"] == "layers" and loads(quantized, "ns").packed is None


def test_format_1_records_are_still_read(record_factory):
    rec = record_factory(10, parent_key="p", start=16)
    out = loads(layered_blob(rec, "ns"), "ns", rec.key)
    assert same(out, rec) and out.packed is None
    assert loads_namespaced_meta(layered_blob(rec, "ns")) == ("ns", rec.meta())


def test_an_unknown_format_is_refused_by_name_not_misread(record_factory):
    blob = layered_blob(record_factory(11), "ns", version=3)
    with pytest.raises(UnsupportedFormatError):
        loads(blob, "ns")
    assert not isinstance(UnsupportedFormatError("x"), CorruptRecordError)  # intact: tiers keep the file
