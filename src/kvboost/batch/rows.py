"""A request inside the scheduler (Row), and the SequenceHandle its caller holds."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from ..decoding import OutputTracker
from ..decoding.speculator import Speculator
from ..kv.manager import Plan
from ..request import Request
from ..results import GenerationMode, GenerationResult
from ..sampling import Sampler
from ..slot import HostSlot


@dataclass
class SequenceHandle:
    """A request inside the scheduler. Deltas are taken by another thread; cancel() from any thread."""

    prompt_text: str | None  # None: the result decodes it from the ids
    prompt_tokens: int
    finished: bool = False
    result: GenerationResult | None = None
    error: Exception | None = None
    _deltas: list[str] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    cancelled: bool = False  # set by cancel()

    def take_deltas(self) -> list[str]:
        with self._lock:
            out, self._deltas = self._deltas, []
        return out

    def cancel(self) -> None:
        self.cancelled = True

    def push(self, delta: str) -> None:
        """The runner's side: text the caller takes next."""
        if delta:
            with self._lock:
                self._deltas.append(delta)


@dataclass
class Row:
    handle: SequenceHandle
    request: Request
    sampler: Sampler
    tracker: OutputTracker
    slot: int = -1
    length: int = 0  # tokens whose K/V is in the slot (or the shared prefix)
    next_token: int = -1  # the last token emitted; its K/V is not computed yet
    plan: Plan | None = None
    ttft_ms: float = 0.0
    spec: Speculator | None = None  # prompt lookup / a draft model: proposes drafts, keeps what its sampler accepts
    max_rows: int | None = None  # runs only in steps of at most this many rows (generate_batch's max_batch_size)
    first_logits: torch.Tensor | None = None  # return_logits: the prompt's last position's logits [vocab]
    host: HostSlot | None = None  # its K/V in host memory (a context longer than the device holds), not in a slot
    unplaced: int = 0  # positions [0, unplaced) its prefill read where the store holds them, not yet in its slot

    @property
    def ids(self) -> list[int]:
        return self.request.ids

    @property
    def mode(self) -> GenerationMode:
        return self.request.mode

    @property
    def salt(self) -> str | None:
        return self.request.salt

    def emit(self, tokens: list[int]) -> None:
        """Tokens the row emitted, in order; those after the one that finishes the output are dropped."""
        for token in tokens:
            self.handle.push(self.tracker.feed(token))
            if self.tracker.finished:
                return
