"""A request inside the continuous-batching runner (Row, and the SequenceHandle its caller holds), and which
requests cannot be rows at all (runs_apart)."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

from ..decoding import OutputTracker
from ..decoding.speculator import Speculator
from ..kv.manager import Plan
from ..request import Request
from ..results import GenerationMode, GenerationResult
from ..sampling import Sampler


@dataclass
class SequenceHandle:
    """A request inside the runner. Deltas are taken by another thread; cancel() from any thread."""

    prompt_text: str | None  # None: the result decodes it from the ids
    prompt_tokens: int
    finished: bool = False
    result: GenerationResult | None = None
    error: Exception | None = None
    _deltas: list[str] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _cancelled: bool = False

    def take_deltas(self) -> list[str]:
        with self._lock:
            out, self._deltas = self._deltas, []
        return out

    def cancel(self) -> None:
        self._cancelled = True

    @property
    def cancelled(self) -> bool:
        return self._cancelled

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
    spec: Speculator | None = None  # prompt lookup: proposes drafts, keeps what its sampler accepts

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
        """Tokens the row emitted, in order (a verify's kept drafts come as one burst); those after the one that
        finishes the output are dropped."""
        for token in tokens:
            self.handle.push(self.tracker.feed(token))
            if self.tracker.finished:
                return


@dataclass(frozen=True)
class RunsApart:
    """Why a request cannot be a row of a batch: the request field that causes it, and the reason."""

    param: str
    reason: str


def runs_apart(engine, request: Request) -> RunsApart | None:
    """Why `request` cannot be a row of a batch (None: it can). Such a request runs one at a time through the
    single-request path: engine.run_batch and the batching server's scheduler run it apart, between batches.

    Prompt-lookup rows are rows: alone they verify drafts as generate() does, beside other rows in ragged steps
    (runner.py). A draft model's proposer runs forwards of its own per sequence, and a seeded sampled row
    would draw differently depending on the company it verified with, so those run apart (as generate() draws)."""
    spec = request.speculative
    if spec is not None and spec.method == "draft":
        return RunsApart("speculative", "a draft model proposes through forwards of its own per sequence, not in "
                         "a batch")
    if spec is not None and not request.params.greedy and request.params.seed is not None:
        return RunsApart("seed", "seeded sampling with speculation draws as generate() does only one request at "
                         "a time (in a batch, its draws would depend on the rows it verified with)")
    positions = len(request.ids) + request.params.max_new_tokens
    if engine.kv.streams(positions):
        return RunsApart("max_tokens", f"prompt + max_new_tokens = {positions} positions is more than "
                         f"device_kv_max_tokens={engine.kv.streamed.max_device_tokens}, so its K/V is streamed "
                         "from host memory one request at a time, not batched")
    return None
