"""Cut token ids into chunks and give each a prefix-chain key H(namespace, parent_key, tokens) (exact reuse) and a
content key H(namespace, tokens) (approximate reuse). The namespace folds in model, dtype, chunking, KV bits, tenant."""
from __future__ import annotations

import contextlib
import json
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from .model.int4.linear import weight_formats
from .store.base import ChunkMeta


@dataclass(frozen=True)
class Chunk:
    index: int
    start: int
    token_ids: tuple[int, ...]
    prefix_key: str
    content_key: str
    parent_key: str | None
    # The cut after this chunk is decided (every longer sequence agreeing so far has it); False for a remainder.
    complete: bool = True

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)

    def meta(self) -> ChunkMeta:
        return ChunkMeta(self.prefix_key, self.parent_key, self.content_key, self.token_ids, self.start)


BOUNDARY_END = 2  # the token's text ends a sentence or clause (. ! ? :) or holds a newline: cut right after it
BOUNDARY_WORD = 1  # the token's text starts a word (a space or the word-start marker): cut right before it
_SENTENCE_ENDS = (".", "!", "?", ":")
_WORD_MARKERS = (" ", "\u0120", "\u2581")  # a space, byte-level BPE's "Ġ", SentencePiece's "▁"
_CLASS_CACHE: weakref.WeakKeyDictionary[object, np.ndarray] = weakref.WeakKeyDictionary()


def boundary_classes(tokenizer) -> np.ndarray:
    """uint8 per token id: BOUNDARY_END and/or BOUNDARY_WORD bits, cached per tokenizer. Word starts come from the raw
    token too (SentencePiece decoders drop a lone token's leading space)."""
    try:
        cached = _CLASS_CACHE.get(tokenizer)
    except TypeError:  # not weak-referenceable / hashable: build every time
        cached = None
    if cached is not None:
        return cached
    size = len(tokenizer)
    raw = tokenizer.convert_ids_to_tokens(list(range(size)))
    out = np.zeros(size, dtype=np.uint8)
    for i in range(size):
        try:
            text = tokenizer.decode([i])
        except Exception:  # a hole in the id space of an added vocabulary
            continue
        token = raw[i] if isinstance(raw[i], str) else ""
        if "\n" in text or text.rstrip(" \t").endswith(_SENTENCE_ENDS):
            out[i] |= BOUNDARY_END
        if text.startswith(" ") or token.startswith(_WORD_MARKERS):
            out[i] |= BOUNDARY_WORD
    out.flags.writeable = False  # shared by every engine on this tokenizer
    with contextlib.suppress(TypeError):
        _CLASS_CACHE[tokenizer] = out
    return out


def _digest(*parts: bytes) -> str:
    h = xxhash.xxh3_128()
    for part in parts:
        # Length-prefix each part so (ab, c) and (a, bc) never hash alike.
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()


class Chunker:
    """Cuts token ids into chunks and keys them. boundary_window W = 0: fixed cuts every chunk_size tokens. W > 0: the
    cut after a chunk starting at s lies in [s + chunk_size - W, s + chunk_size + W]: after a sentence end if any, else
    before a word start, else nominal; closest to nominal wins, earlier on a tie. Cuts depend on the ids alone."""

    def __init__(self, chunk_size: int, namespace: str, boundary_window: int = 0,
                 boundary_classes: np.ndarray | None = None):
        if boundary_window and boundary_classes is None:
            raise ValueError("a boundary window needs boundary_classes (see chunking.boundary_classes)")
        self.chunk_size, self.namespace, self.boundary_window = chunk_size, namespace, boundary_window
        # One zero past the vocabulary: ids the table does not know (a padded embedding) are no boundary.
        self._classes = (np.append(np.asarray(boundary_classes, dtype=np.uint8), np.uint8(0))
                         if boundary_window else None)

    def _ns(self, salt: str | None) -> bytes:
        return (self.namespace + "|salt=" + (salt or "")).encode()

    def root_key(self, salt: str | None = None) -> str:
        """Parent of every chain's first chunk, namespaced so child searches never cross models or tenants."""
        return _digest(b"root", self._ns(salt))

    def spans(self, token_ids: Sequence[int] | np.ndarray, end: int | None = None) -> list[tuple[int, int, bool]]:
        """(start, stop, complete) of every chunk, in order (with `end`: those with stop <= end, cut as in the whole
        sequence). complete: every longer sequence sharing enough leading tokens has this chunk; never the remainder."""
        size, w, n = self.chunk_size, self.boundary_window, len(token_ids)
        limit = n if end is None else min(n, end)
        if w == 0:
            return [(s, min(s + size, n), s + size <= n) for s in range(0, limit, size) if min(s + size, n) <= limit]
        # Cut c's class: 2 if token c-1 ends a sentence, 1 if token c starts a word, else 0.
        m = n if end is None else min(n, end + 2 * w + 1)
        ids = np.asarray(token_ids[:m], dtype=np.int64)
        cls = self._classes[np.clip(ids, 0, len(self._classes) - 1)]
        score = np.zeros(m + 1, dtype=np.uint8)
        score[1:m] = np.maximum((cls[:-1] & BOUNDARY_END), cls[1:] & BOUNDARY_WORD)
        table = score.tobytes()
        out: list[tuple[int, int, bool]] = []
        s = 0
        while s < limit:
            nominal = s + size
            if nominal + w >= n:  # the window is not all there: do not guess, the rest is the remainder
                if n <= limit:
                    out.append((s, n, False))
                break
            c = _pick(table, nominal - w, nominal, nominal + w)
            if c > limit:
                break
            out.append((s, c, True))
            s = c
        return out

    def split(self, token_ids: Sequence[int], salt: str | None = None, include_partial: bool = True,
              end: int | None = None) -> list[Chunk]:
        """Chunks from position 0 (see spans()), plus the trailing incomplete one when include_partial."""
        chunks: list[Chunk] = []
        parent, ns = self.root_key(salt), self._ns(salt)
        # One conversion for the whole sequence: cuts, per-chunk tuples and bytes all come from slices of it.
        arr = np.asarray(token_ids, dtype=np.int64)
        for index, (start, stop, complete) in enumerate(self.spans(arr, end)):
            if not complete and not include_partial:
                break
            piece = arr[start:stop]
            raw = piece.tobytes()
            key, content = _digest(ns, parent.encode(), raw), _digest(b"content", ns, raw)
            chunks.append(Chunk(index, start, tuple(piece.tolist()), key, content, parent, complete))
            parent = key
        return chunks


def _pick(table: bytes, lo: int, nominal: int, hi: int) -> int:
    """Best cut in [lo, hi] by class (2 over 1 over 0), then closeness to nominal, then the earlier one."""
    for cls in (b"\x02", b"\x01"):
        left = table.rfind(cls, lo, nominal + 1)  # closest at or before the nominal cut
        right = table.find(cls, nominal + 1, hi + 1)  # closest after it
        if left >= 0 and (right < 0 or nominal - left <= right - nominal):
            return left
        if right >= 0:
            return right
    return nominal


def model_fingerprint(model: torch.nn.Module) -> str:
    """Architecture + config + a sample of the weights: two checkpoints of one architecture never share keys."""
    config_dict = model.config.to_dict()
    for volatile in ("_name_or_path", "transformers_version", "_commit_hash", "name_or_path", "dtype", "torch_dtype"):
        config_dict.pop(volatile, None)
    h = xxhash.xxh3_128()
    h.update(type(model).__name__.encode())
    h.update(json.dumps(config_dict, sort_keys=True, default=str).encode())
    formats = weight_formats(model)
    if formats:  # quantized layers (model/int4) compute other K/V than the float model's
        h.update(("formats:" + ",".join(formats)).encode())
    params = [p for _, p in model.named_parameters()]
    for p in (params[0], params[len(params) // 2], params[-1]) if params else ():
        h.update(p.detach().reshape(-1)[:4096].float().cpu().numpy().tobytes())
    return h.hexdigest()


def make_namespace(fingerprint: str, dtype: torch.dtype, chunk_size: int, kv_bits: int,
                   boundary_window: int = 0) -> str:
    return f"kvb1|{fingerprint}|{str(dtype).removeprefix('torch.')}|c{chunk_size}|w{boundary_window}|b{kv_bits}"
