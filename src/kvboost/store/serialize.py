"""ChunkRecord <-> bytes, shared by the disk and Redis tiers: a 24-byte frame (magic, body length, xxh3_64 of the
body) then a safetensors body (token ids, K/V "packed" [layers, 2, kv_heads, n, d] or per layer, a JSON header).
Unknown formats raise UnsupportedFormatError (never deleted: a newer kvboost may share the directory). No pickle."""
from __future__ import annotations

import json
import math
import struct
from typing import Any

import torch
import xxhash
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from ..errors import KVBoostError
from .base import ChunkMeta, ChunkRecord
from .quant import Encoded, QuantCodec, QuantRecord, QuantTensor, decode_key, decode_value

MAGIC = b"KVBOOST\x01"
FRAME = struct.Struct("<8sQQ")  # magic, body length, xxh3_64(body)
FRAME_SIZE = FRAME.size
FORMAT_VERSION = 2
READABLE_FORMATS = (1, 2)
_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.uint8, torch.int8)}


class RecordError(KVBoostError):
    """A stored record cannot be served; tiers count it and treat it as a miss."""


class CorruptRecordError(RecordError):
    """Truncated, bit-flipped, unparsable or internally inconsistent bytes."""


class UnsupportedFormatError(RecordError):
    """An intact record of a format version this code cannot read (written by a newer kvboost)."""


class NamespaceMismatchError(RecordError):
    """The record was written for another model fingerprint / salt, or under another key."""


def checksum(body: bytes | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(body)


def dumps(record: ChunkRecord | QuantRecord, namespace: str, codec: QuantCodec | None = None) -> bytes:
    """Serialize a record; with a codec, full-precision K/V are quantized first (QuantRecords go as they are)."""
    if isinstance(record, ChunkRecord) and codec is not None:
        record = codec.encode(record)
    meta, bits = (record.meta, record.bits) if isinstance(record, QuantRecord) else (record.meta(), 16)
    keys, values = record.keys, record.values
    tensors: dict[str, torch.Tensor] = {"token_ids": torch.tensor(meta.token_ids, dtype=torch.int64)}
    layout: dict[str, Any] = {}
    dtype = None
    packed = record.stacked() if isinstance(record, ChunkRecord) else None
    if packed is not None:
        tensors["kv"] = _cpu(packed)
        dtype = packed.dtype
    for kind, layer_list in (("k", keys), ("v", values)) if packed is None else ():
        for i, t in enumerate(layer_list):
            name = f"{kind}.{i}"
            if isinstance(t, QuantTensor):
                tensors[name + ".q"] = _cpu(t.data)
                tensors[name + ".scale"] = _cpu(t.scale)
                tensors[name + ".zero"] = _cpu(t.zero)
                layout[name] = {"shape": list(t.shape), "axis": t.axis, "group_size": t.group_size,
                                "bits": t.bits, "dtype": _dtype_name(t.dtype)}
            else:
                tensors[name] = _cpu(t)
            dtype = dtype or t.dtype
    header = {
        "format": FORMAT_VERSION, "key": meta.key, "parent_key": meta.parent_key, "content_key": meta.content_key,
        "start": meta.start, "bits": bits, "dtype": _dtype_name(dtype) if dtype is not None else None,
        "namespace": namespace, "n_layers": len(keys), "layout": "layers" if packed is None else "packed",
        "quantized": layout,
    }
    body = st_save(tensors, metadata={"kvboost": json.dumps(header, separators=(",", ":"))})
    return FRAME.pack(MAGIC, len(body), checksum(body)) + body


def loads(blob: bytes, namespace: str | None = None, key: str | None = None) -> ChunkRecord:
    """Verify and decode to CPU tensors; CorruptRecordError for damage, NamespaceMismatchError otherwise."""
    header, tensors = _verify(blob, namespace)
    if key is not None and header["key"] != key:
        raise NamespaceMismatchError(f"record key {header['key']!r} != requested {key!r}")
    try:
        return _decode(header, tensors)
    except RecordError:
        raise
    except Exception as exc:  # shapes that do not fit together: damage the checksum could not see
        raise CorruptRecordError(f"inconsistent record: {exc}") from exc


def loads_namespaced_meta(blob: bytes) -> tuple[str, ChunkMeta]:
    """(the namespace it was written under, its metadata) of a verified blob of any namespace."""
    header, tensors = _verify(blob, None)
    return header["namespace"], _meta(header, tensors)


# ---- internals -----------------------------------------------------------------------------------
def _verify(blob: bytes | memoryview, namespace: str | None) -> tuple[dict, dict[str, torch.Tensor]]:
    """The header and tensors of an intact blob; NamespaceMismatchError when written under another namespace."""
    if len(blob) < FRAME_SIZE:
        raise CorruptRecordError(f"truncated: {len(blob)} bytes is shorter than the frame")
    magic, length, digest = FRAME.unpack_from(blob)
    if magic != MAGIC:
        raise CorruptRecordError("bad magic: not a kvboost record")
    if len(blob) - FRAME_SIZE != length:
        raise CorruptRecordError(f"truncated or padded: body is {len(blob) - FRAME_SIZE} bytes, frame says {length}")
    body = bytes(memoryview(blob)[FRAME_SIZE:])
    if checksum(body) != digest:
        raise CorruptRecordError("checksum mismatch")
    try:
        tensors = st_load(body)
        (n,) = struct.unpack_from("<Q", body)  # safetensors: the JSON header's length, then the header
        raw_header = (json.loads(body[8:8 + n]).get("__metadata__") or {}).get("kvboost")
        header = json.loads(raw_header) if raw_header else None
    except Exception as exc:
        raise CorruptRecordError(f"unparsable body: {exc}") from exc
    if not isinstance(header, dict) or not isinstance(header.get("format"), int):
        raise CorruptRecordError("missing header or format version")
    if header["format"] not in READABLE_FORMATS:  # intact (the checksum held), just not ours to read
        raise UnsupportedFormatError(f"record format {header['format']}; this kvboost reads {READABLE_FORMATS}")
    if header.get("layout", "layers") not in ("layers", "packed") or (header["format"] == 1 and "layout" in header):
        raise CorruptRecordError(f"unknown K/V layout {header.get('layout')!r}")
    for field, kind in (("key", str), ("content_key", str), ("namespace", str), ("start", int), ("n_layers", int),
                        ("bits", int), ("quantized", dict)):
        if not isinstance(header.get(field), kind):
            raise CorruptRecordError(f"header field {field!r} missing or not {kind.__name__}")
    if header.get("parent_key") is not None and not isinstance(header["parent_key"], str):
        raise CorruptRecordError("header field 'parent_key' is not a string")
    if namespace is not None and header["namespace"] != namespace:
        raise NamespaceMismatchError(f"record namespace {header['namespace']!r} != {namespace!r}")
    return header, tensors


def _meta(header: dict, tensors: dict[str, torch.Tensor]) -> ChunkMeta:
    token_ids = tensors.get("token_ids")
    if token_ids is None or token_ids.dim() != 1:
        raise CorruptRecordError("token_ids missing")
    return ChunkMeta(header["key"], header["parent_key"], header["content_key"],
                     tuple(int(t) for t in token_ids.tolist()), header["start"])


def _decode(header: dict, tensors: dict[str, torch.Tensor]) -> ChunkRecord:
    meta = _meta(header, tensors)
    n_tokens = len(meta.token_ids)
    if header.get("layout") == "packed":
        kv = tensors.get("kv")
        if kv is None or kv.dim() != 5 or kv.shape[0] != header["n_layers"] or kv.shape[1] != 2 \
                or kv.shape[3] != n_tokens or _dtype_name(kv.dtype) != header["dtype"]:
            raise CorruptRecordError(f"packed K/V {None if kv is None else tuple(kv.shape)} does not fit "
                                     f"{header['n_layers']} layers x {n_tokens} tokens")
        return ChunkRecord.from_packed(meta, kv)
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    for i in range(header["n_layers"]):
        k = decode_key(_encoded(header, tensors, f"k.{i}"))
        v = decode_value(_encoded(header, tensors, f"v.{i}"), k.shape[0] if k.dim() == 3 else 1)
        if k.dim() != 3 or k.shape[1] != n_tokens or v.shape[:2] != k.shape[:2]:
            raise CorruptRecordError(f"layer {i}: K {tuple(k.shape)} / V {tuple(v.shape)} do not fit {n_tokens} tokens")
        keys.append(k)
        values.append(v)
    return ChunkRecord.of(meta, keys, values)


def _encoded(header: dict, tensors: dict[str, torch.Tensor], name: str) -> Encoded:
    spec = header["quantized"].get(name)
    if spec is None:
        if name not in tensors:
            raise CorruptRecordError(f"tensor {name} missing")
        return tensors[name]
    try:
        q = QuantTensor(tensors[name + ".q"], tensors[name + ".scale"], tensors[name + ".zero"], int(spec["bits"]),
                        tuple(int(d) for d in spec["shape"]), int(spec["axis"]), int(spec["group_size"]),
                        _DTYPES[spec["dtype"]])
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptRecordError(f"quantized tensor {name} incomplete: {exc}") from exc
    if q.bits not in (4, 8) or q.data.dtype != torch.uint8 or q.scale.dtype != torch.float16 or len(q.shape) < 1:
        raise CorruptRecordError(f"quantized tensor {name}: bad dtype or bits")
    if not 0 <= q.axis < len(q.shape) or q.group_size < 1:
        raise CorruptRecordError(f"quantized tensor {name}: bad axis/group size")
    numel = math.prod(q.shape)
    expected = (numel + 1) // 2 if q.bits == 4 else numel
    length = q.shape[q.axis]
    groups = -(-length // q.group_size)
    other = [d for i, d in enumerate(q.shape) if i != q.axis]
    if q.data.numel() != expected or list(q.scale.shape) != other + [groups] or q.zero.shape != q.scale.shape:
        raise CorruptRecordError(f"quantized tensor {name}: parts do not match shape {q.shape}")
    return q


def _cpu(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().to("cpu").contiguous()
    # safetensors refuses tensors that share storage (a chunk sliced out of a whole-sequence cache does).
    if t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone()
    return t


def _dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"unsupported K/V dtype {dtype}")
    return name
