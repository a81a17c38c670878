"""Deterministic synthetic chunk records, shared by the tests and the subprocess writers they spawn.

Run as a script it is a writer process: `python _synth.py DIR NAMESPACE FIRST LAST BUDGET [LAYERS HEADS TOKENS DIM]`
writes records FIRST..LAST-1 into a DiskStore, printing each index once stored (the parent reads
these lines to know when to kill it). With KVBOOST_TEST_GO=PATH it prints "ready" and waits for PATH to exist.
"""
from __future__ import annotations

import os
import socket
import sys
import time

import torch  # noqa: E402

from kvboost.store.base import ChunkRecord  # noqa: E402


def make_record(seed: int, layers: int = 4, heads: int = 2, tokens: int = 16, head_dim: int = 16,
                dtype: torch.dtype = torch.float32, parent_key: str | None = None, content_key: str | None = None,
                key: str | None = None, start: int = 0, device: torch.device | str | None = None) -> ChunkRecord:
    """A record on `device` (default cpu: this module also runs as a writer script, outside pytest); the values
    are drawn on the CPU, so a seed means the same record on every device."""
    device = device if device is not None else "cpu"
    g = torch.Generator().manual_seed(seed)
    keys = [torch.randn(heads, tokens, head_dim, generator=g).to(device=device, dtype=dtype) for _ in range(layers)]
    values = [torch.randn(heads, tokens, head_dim, generator=g).to(device=device, dtype=dtype)
              for _ in range(layers)]
    token_ids = tuple(int(t) for t in torch.randint(0, 50_000, (tokens,), generator=g))
    return ChunkRecord(key or f"chunk-{seed}", parent_key, content_key or f"content-{seed}", token_ids, start,
                       keys, values)


def same(a: ChunkRecord, b: ChunkRecord) -> bool:
    return (a.meta() == b.meta() and len(a.keys) == len(b.keys)
            # .cpu(): a record read back from disk or Redis lives on the CPU, the original on the device
            and all(torch.equal(x.cpu(), y.cpu()) for x, y in zip(a.keys + a.values, b.keys + b.values)))


def layered_blob(record: ChunkRecord, namespace: str, version: int = 1) -> bytes:
    """The bytes a format-1 writer (kvboost before 0.2.0) made of a full-precision record: per-layer tensors
    "k.{i}" / "v.{i}" and a header without "layout", framed and checksummed; `version` relabels the format
    (an intact record of a version this code does not know)."""
    import json
    import struct

    import xxhash
    from safetensors.torch import save

    tensors = {"token_ids": torch.tensor(record.token_ids, dtype=torch.int64)}
    for i, (k, v) in enumerate(zip(record.keys, record.values)):
        tensors[f"k.{i}"], tensors[f"v.{i}"] = k.contiguous().clone(), v.contiguous().clone()
    header = {"format": version, "key": record.key, "parent_key": record.parent_key,
              "content_key": record.content_key, "start": record.start, "bits": 16,
              "dtype": str(record.keys[0].dtype).removeprefix("torch."), "namespace": namespace,
              "n_layers": len(record.keys), "quantized": {}}
    body = save(tensors, metadata={"kvboost": json.dumps(header)})
    return struct.pack("<8sQQ", b"KVBOOST\x01", len(body), xxhash.xxh3_64_intdigest(body)) + body


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _writer(argv: list[str]) -> None:
    from kvboost.store.disk import DiskStore

    directory, namespace, first, last, budget = argv[:5]
    shape = [int(x) for x in argv[5:9]] if len(argv) >= 9 else [8, 4, 128, 64]
    store = DiskStore(directory, int(budget) if int(budget) > 0 else None, namespace=namespace)
    go = os.environ.get("KVBOOST_TEST_GO")
    if go:  # start line: both writers begin together, so their writes really interleave
        print("ready", flush=True)
        while not os.path.exists(go):
            time.sleep(0.001)
    for i in range(int(first), int(last)):
        rec = make_record(i, *shape)
        ok = store.put(rec)
        print(f"{i} {int(ok)}", flush=True)
    store.close()


if __name__ == "__main__":
    _writer(sys.argv[1:])
