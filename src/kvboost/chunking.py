"""Cut token ids into fixed-size chunks and give each a prefix-chain key and a content key.

prefix_key = H(namespace ‖ parent_key ‖ tokens): equal only when every earlier token is equal too,
so stored K/V (computed in full context) is exactly right. content_key = H(namespace ‖ tokens):
equal wherever the same tokens appear, whatever came before; reuse through it is approximate.
The namespace folds in the model fingerprint, dtype, chunk settings, KV bits and tenant salt, so
keys from another model or tenant can never collide with ours.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import xxhash


@dataclass(frozen=True)
class Chunk:
    index: int
    start: int
    token_ids: tuple[int, ...]
    prefix_key: str
    content_key: str
    parent_key: str | None

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


def _digest(*parts: bytes) -> str:
    h = xxhash.xxh3_128()
    for part in parts:
        # Length-prefix each part so (ab, c) and (a, bc) never hash alike.
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    return np.asarray(token_ids, dtype=np.int64).tobytes()


class Chunker:
    def __init__(self, chunk_size: int, namespace: str):
        self.chunk_size = chunk_size
        self.namespace = namespace

    def _ns(self, salt: str | None) -> bytes:
        return (self.namespace + "|salt=" + (salt or "")).encode()

    def root_key(self, salt: str | None = None) -> str:
        """Parent of every chain's first chunk. Namespaced, so the token-granular search among a
        parent's children never crosses models or tenants, even at the first chunk."""
        return _digest(b"root", self._ns(salt))

    def prefix_key(self, parent_key: str | None, token_ids: Sequence[int], salt: str | None = None) -> str:
        return _digest(self._ns(salt), (parent_key or "").encode(), _token_bytes(token_ids))

    def content_key(self, token_ids: Sequence[int], salt: str | None = None) -> str:
        return _digest(b"content", self._ns(salt), _token_bytes(token_ids))

    def split(self, token_ids: Sequence[int], salt: str | None = None, include_partial: bool = True) -> list[Chunk]:
        """Full chunks from position 0, plus the trailing partial chunk when include_partial."""
        chunks: list[Chunk] = []
        parent: str | None = self.root_key(salt)
        size = self.chunk_size
        n = len(token_ids)
        stop = n if include_partial else n - n % size
        for index, start in enumerate(range(0, stop, size)):
            ids = tuple(int(t) for t in token_ids[start:min(start + size, stop)])
            key = self.prefix_key(parent, ids, salt)
            chunks.append(Chunk(index, start, ids, key, self.content_key(ids, salt), parent))
            parent = key
        return chunks


def model_fingerprint(model: torch.nn.Module) -> str:
    """Architecture + config + a sample of the weights: two checkpoints of one architecture never share keys."""
    config = model.config
    config_dict = config.to_dict()
    for volatile in ("_name_or_path", "transformers_version", "_commit_hash", "name_or_path", "dtype", "torch_dtype"):
        config_dict.pop(volatile, None)
    h = xxhash.xxh3_128()
    h.update(type(model).__name__.encode())
    h.update(json.dumps(config_dict, sort_keys=True, default=str).encode())
    params = [p for _, p in model.named_parameters()]
    for p in (params[0], params[len(params) // 2], params[-1]) if params else ():
        sample = p.detach().reshape(-1)[:4096].float().cpu().numpy().tobytes()
        h.update(sample)
    return h.hexdigest()


def make_namespace(fingerprint: str, dtype: torch.dtype, chunk_size: int, kv_bits: int,
                   boundary_window: int = 0) -> str:
    return f"kvb1|{fingerprint}|{str(dtype).removeprefix('torch.')}|c{chunk_size}|w{boundary_window}|b{kv_bits}"
