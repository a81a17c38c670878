"""What one replica holds, as the router compares it: the short forms of the chunk keys in its fast tiers, kept up to
date from the store's watch (the same notices the KV-event publisher gets)."""
from __future__ import annotations

import threading
from collections.abc import Callable

from ..store.base import ChunkMeta
from .routing import short_key

Listener = Callable[[str, ChunkMeta | None, str], None]


class HeldKeys:
    """A store listener (TieredStore.watch): "stored" / "removed" a chunk in a tier (medium), "cleared" a tier. A chunk
    counts as held while any fast tier holds it. `also` is told of every notice too (a KV-event publisher)."""

    def __init__(self, also: Listener | None = None):
        self.also = also
        self._by_medium: dict[str, dict[str, str]] = {}  # medium -> {short prefix-chain key: short content key}
        self._lock = threading.Lock()

    def __call__(self, kind: str, meta: ChunkMeta | None, medium: str) -> None:
        with self._lock:
            held = self._by_medium.setdefault(medium, {})
            if kind == "cleared":
                held.clear()
            elif meta is not None and kind == "stored":
                held[short_key(meta.key)] = short_key(meta.content_key)
            elif meta is not None and kind == "removed":
                held.pop(short_key(meta.key), None)
        if self.also is not None:
            self.also(kind, meta, medium)

    def report(self) -> dict[str, list[str]]:
        """{"chains": [...], "contents": [...]}: small enough to send every second (16 hex digits a key)."""
        with self._lock:
            return {"chains": sorted({k for held in self._by_medium.values() for k in held}),
                    "contents": sorted({c for held in self._by_medium.values() for c in held.values()})}
