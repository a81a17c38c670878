"""KV events in vLLM's format (`kvboost serve --kv-events tcp://*:5557`): the chunks this replica's fast tiers store
and drop, for KV-aware routers that read vLLM's events (llm-d's precise prefix-cache scorer, Dynamo's KV router).

On the wire as vLLM publishes them: a ZMQ PUB socket sends [topic, sequence number (8 bytes, big-endian), payload],
the payload a msgpack `KVEventBatch` array [ts, events] whose events are maps tagged by "type": `BlockStored`
(block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name), `BlockRemoved` (block_hashes,
medium) and `AllBlocksCleared` (vllm-router's KV index refuses array-encoded events: "KV event must be a tagged
map"). A block is a chunk (block_size = chunk_size); its hash is the first 64 bits of the chunk's prefix-chain key
(cluster/routing.short_key as an integer), its parent's likewise (None for a first chunk); medium is "GPU" or "CPU"
for the device tier, "CPU" for the host tier. The store's listener only queues; a thread sends a batch every
`interval_s`, so a slow or absent subscriber never slows the engine (PUB drops what nobody reads)."""
from __future__ import annotations

import threading
import time
from collections import deque

import msgspec

from ..store.base import ChunkMeta


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """A change in what this replica holds."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None  # vllm-router's KV index requires the field (None: no adapter)


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def block_hash(key: str) -> int:
    return int(key[:16], 16)


class KVEventPublisher:
    """Binds `endpoint` and publishes the store's changes (give it to `TieredStore.watch`)."""

    def __init__(self, endpoint: str, chunk_size: int, topic: str = "", interval_s: float = 0.05):
        import zmq

        self.chunk_size, self.topic, self.interval_s = chunk_size, topic.encode(), interval_s
        self.socket = zmq.Context.instance().socket(zmq.PUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        try:
            self.socket.bind(endpoint)
        except zmq.ZMQError as exc:
            self.socket.close()
            raise ValueError(f"cannot publish KV events on {endpoint!r}: {exc}") from None
        self.sequence = 0
        self._pending: deque[KVCacheEvent] = deque()
        self._encoder = msgspec.msgpack.Encoder()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvboost-kv-events", daemon=True)
        self._thread.start()

    def __call__(self, kind: str, meta: ChunkMeta | None, medium: str) -> None:
        if kind == "cleared":
            self._pending.append(AllBlocksCleared())
        elif kind == "stored":
            parent = None if meta.start == 0 or meta.parent_key is None else block_hash(meta.parent_key)
            self._pending.append(BlockStored([block_hash(meta.key)], parent, list(meta.token_ids), self.chunk_size,
                                             None, medium, None))
        else:
            self._pending.append(BlockRemoved([block_hash(meta.key)], medium))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._send()
        self._send()

    def _send(self) -> None:
        events = [self._pending.popleft() for _ in range(len(self._pending))]
        if not events:
            return
        payload = self._encoder.encode(KVEventBatch(ts=time.time(), events=events))
        self.socket.send_multipart([self.topic, self.sequence.to_bytes(8, "big"), payload])
        self.sequence += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.socket.close()
