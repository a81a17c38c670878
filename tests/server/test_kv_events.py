"""server/kv_events.py: `--kv-events` publishes vLLM-format KV events, read here by an independent subscriber with its
own msgspec schema (written from vLLM's kv_events_subscriber example, with events as tagged maps, as vllm-router's
KV index reads them): [topic, 8-byte big-endian sequence number, msgpack KVEventBatch]. A prompt's chunks arrive as
BlockStored events chained by their parents, block_size the chunk size, the tokens the chunks'; clearing the cache
is AllBlocksCleared; a port already taken is refused."""
from __future__ import annotations

import time
from typing import Any

import pytest

from kvboost import KVBoost

from ..prompts import text_with_tokens
from .conftest import TINY_NAME

zmq = pytest.importorskip("zmq")
msgspec = pytest.importorskip("msgspec")


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None  # no default: an event without it fails to decode, as vllm-router refuses it


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _receive(sub, until, timeout_s: float = 10.0) -> list[tuple[int, Any]]:
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    got: list[tuple[int, Any]] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not until(got):
        if sub.poll(100):
            _, seq, payload = sub.recv_multipart()
            got += [(int.from_bytes(seq, "big"), e) for e in decoder.decode(payload).events]
    return got


def test_the_chunks_a_request_stores_arrive_as_vllm_events(tiny_model_dir, tokenizer, start_server, device):
    engine = KVBoost.from_pretrained(str(tiny_model_dir), chunk_size=16, device=str(device))
    port = _free_port()
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        with start_server(engine, kv_events=f"tcp://127.0.0.1:{port}") as srv:
            sub.connect(f"tcp://127.0.0.1:{port}")
            time.sleep(0.3)  # a SUB socket joins late: what is published before it has connected is gone
            prompt = text_with_tokens(tokenizer, 70)
            srv.client().completions.create(model=TINY_NAME, prompt=prompt, max_tokens=2, temperature=0)
            ids = tokenizer(prompt)["input_ids"]
            got = _receive(sub, lambda g: sum(isinstance(e, BlockStored) for _, e in g) >= len(ids) // 16)
            stored = [e for _, e in got if isinstance(e, BlockStored)]
            assert len(stored) >= len(ids) // 16
            first = stored[:len(ids) // 16]
            assert [e.token_ids for e in first] == [ids[i:i + 16] for i in range(0, 16 * len(first), 16)]
            assert all(e.block_size == 16 and e.medium == ("GPU" if device.type == "cuda" else "CPU") for e in first)
            assert first[0].parent_block_hash is None
            assert [e.parent_block_hash for e in first[1:]] == [e.block_hashes[0] for e in first[:-1]]
            seqs = [s for s, _ in got]
            assert seqs == sorted(seqs) and seqs[0] == 0
            engine.clear_cache()
            cleared = _receive(sub, lambda g: any(isinstance(e, AllBlocksCleared) for _, e in g))
            assert any(isinstance(e, AllBlocksCleared) for _, e in cleared)
            with pytest.raises(ValueError, match="cannot publish KV events"):
                with start_server(engine, kv_events=f"tcp://127.0.0.1:{port}"):
                    pass
    finally:
        sub.close()
