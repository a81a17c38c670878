"""The one worker thread that steps the engine's loop for the server, and the bounded queue (full -> 429) feeding it.
An idle worker waits up to the batch window so requests arriving together prefill together."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from ..results import GenerationResult
from ..sampling import SamplingParams

log = logging.getLogger("kvboost.server")

Event = (tuple[Literal["delta"], str] | tuple[Literal["done"], GenerationResult]
         | tuple[Literal["error"], BaseException])


class QueueFullError(Exception):
    """The request queue is at max_queue; the client should retry after `retry_after` seconds."""

    def __init__(self, max_queue: int, retry_after: int):
        super().__init__(f"the server's request queue is full ({max_queue} waiting); retry after {retry_after}s")
        self.retry_after = retry_after


class ShuttingDownError(Exception):
    """The server stopped before this request ran."""


@dataclass(eq=False)
class Job:
    """One request on its way through the worker. Created on the event loop; events come back to it."""

    ids: list[int]
    params: SamplingParams
    prompt_text: str | None  # None: decoded from ids in the result, after the first token
    loop: asyncio.AbstractEventLoop
    # engine.make_request's keywords: mode, cache_salt, content_reuse (unset: the engine's), output_format (the
    # grammar the output must follow), speculative (SpeculativeParams, e.g. from a prediction; unset: the engine's)
    options: dict[str, Any] = field(default_factory=dict)
    t_start: float = field(default_factory=time.perf_counter)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    result: GenerationResult | None = None
    finished: bool = False  # set on the event loop when the last event was taken
    _cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        """Thread-safe: the worker drops the request if queued, or stops its generation at the next step."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def emit(self, kind: str, payload: Any) -> None:
        """From the worker thread: hand one event to the event loop (dropped if the loop has closed)."""
        with contextlib.suppress(RuntimeError):  # loop closed: nobody is listening any more
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))

    async def stream(self) -> AsyncIterator[Event]:
        """Events until (and including) the final "done" or "error"."""
        while True:
            event = await self.events.get()
            if event[0] != "delta":
                self.finished = True
                if event[0] == "done":
                    self.result = event[1]
            yield event
            if self.finished:
                return


@dataclass
class SchedulerStats:
    completed: int = 0
    failed: int = 0
    cancelled: int = 0
    rejected: int = 0
    batch_steps: int = 0  # steps of the engine's loop that prefilled or decoded something
    max_rows_in_a_step: int = 0


class Scheduler:
    def __init__(self, engine, max_batch_size: int = 16, batch_window_ms: float = 20.0, max_queue: int = 256):
        self.engine, self.max_batch_size, self.max_queue = engine, max_batch_size, max_queue
        self.batch_window_s = batch_window_ms / 1e3
        self.tokenizer_lock = threading.Lock()
        self.stats = SchedulerStats()
        self._queue: queue.Queue[Job] = queue.Queue(maxsize=max_queue)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._active = 0
        self._rows: dict[Job, Any] = {}  # submitted jobs -> their handles in the engine's loop
        self._start_lock = threading.Lock()
        self._in_caller = False  # run_here(): the loop runs in the thread that called it, start() spawns nothing
        self._caller_done: threading.Event | None = None  # set when run_here's loop has ended

    # ---- control, from any thread ----------------------------------------------------------------
    @property
    def batched(self) -> bool:
        return self.max_batch_size > 1

    def start(self) -> None:
        with self._start_lock:
            if self._in_caller or self.alive:
                return
            self._stop.clear()
            self._thread = threading.Thread(target=self._main, name="kvboost-worker", daemon=True)
            self._thread.start()

    def run_in_caller(self) -> None:
        """The loop runs where run_here() is called from now on (an earlier worker ends first)."""
        self.stop()
        with self._start_lock:
            self._in_caller = True
            self._thread = threading.current_thread()
            self._caller_done = threading.Event()
            self._stop.clear()

    def run_here(self) -> None:
        """Run the worker loop in the calling thread until stop() is called from another one. `kvboost serve` runs it on
        the main thread: with GNU OpenMP, a worker thread beside the main one ran decode ~2x slower."""
        if not self._in_caller or self._thread is not threading.current_thread():
            self.run_in_caller()
        assert self._caller_done is not None
        try:
            self._main()
        finally:
            self._caller_done.set()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            if self._caller_done is not None:  # the loop runs in a thread that lives on after it (run_here)
                self._caller_done.wait(timeout)
            else:
                self._thread.join(timeout)
        while (job := self._next()) is not None:  # whoever still waits gets an answer
            job.emit("error", ShuttingDownError("the server is shutting down"))

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, job: Job) -> None:
        if not self.alive and not self._stop.is_set():
            self.start()  # a worker that died somehow is replaced rather than leaving requests hanging
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            self.stats.rejected += 1
            retry_after = 1 if self.batched else max(1, min(30, self._queue.qsize() // 4))
            raise QueueFullError(self.max_queue, retry_after) from None

    def queue_depth(self) -> int:
        return self._queue.qsize()

    def active_count(self) -> int:
        return self._active

    def snapshot(self) -> dict[str, Any]:
        return {"mode": "batched" if self.batched else "single", "worker_alive": self.alive,
                "queued": self.queue_depth(), "active": self.active_count(), "max_queue": self.max_queue,
                "max_batch_size": self.max_batch_size, "batch_window_ms": self.batch_window_s * 1e3,
                **asdict(self.stats)}

    # ---- the worker thread ---------------------------------------------------------------------------
    def _main(self) -> None:
        while not self._stop.is_set():
            try:
                self._loop()
            except Exception as exc:  # a bug in the loop itself: fail what it held, log, keep serving
                log.exception("scheduler worker loop failed; restarting it")
                for job, handle in self._rows.items():
                    handle.cancel()
                    self.stats.failed += 1
                    job.emit("error", exc)
                self._rows = {}
                self._active = 0
                time.sleep(0.05)

    def _next(self, wait_s: float = 0.0) -> Job | None:
        """The next queued job still wanted (cancelled ones are dropped here) within wait_s seconds, or None."""
        deadline = time.perf_counter() + wait_s
        while True:
            try:
                job = self._queue.get(timeout=max(0.0, deadline - time.perf_counter()))
            except queue.Empty:
                return None
            if not job.cancelled:
                return job
            self.stats.cancelled += 1

    def _loop(self) -> None:
        rows = self._rows = {}
        while not self._stop.is_set():
            new: list[Job] = []  # submitted in this iteration: the loop prefills them in the next step
            deadline = None  # running: whatever queued meanwhile joins the next step
            if not rows:
                job = self._next(0.1)
                if job is None:
                    self.engine.grow_ahead()  # idle: the allocation a growing chat needs is made now
                    continue
                self._admit(job, rows, new)
                # The batch window: requests arriving now prefill together (shared prefix K/V loaded once).
                deadline = time.perf_counter() + self.batch_window_s
            while len(rows) < self.max_batch_size and (deadline is None or self.batched):
                job = self._next(0.0 if deadline is None else max(0.0, deadline - time.perf_counter()))
                if job is None:
                    break
                self._admit(job, rows, new)
            for job, handle in rows.items():
                if job.cancelled:
                    handle.cancel()
            self._active = len(rows)
            if not rows:
                continue
            # Several new rows: their prefills run one after another inside this step.
            pumped = _first_tokens([(job, rows[job]) for job in new if job in rows]) if len(new) > 1 else None
            try:
                with pumped or contextlib.nullcontext():
                    self.engine.step()
            except Exception:  # the loop failed its rows (each handle has the error); the worker goes on
                log.exception("a step of the engine's loop failed; failing %d request(s)", len(rows))
            self.stats.batch_steps += 1
            self.stats.max_rows_in_a_step = max(self.stats.max_rows_in_a_step, len(rows))
            self._deliver(rows)
            self._active = len(rows)
        for job, handle in rows.items():  # shutting down
            handle.cancel()
            job.emit("error", ShuttingDownError("the server is shutting down"))
        self._active = 0

    def _admit(self, job: Job, rows: dict[Job, Any], new: list[Job]) -> None:
        try:  # validated with the ids the job came with: never tokenized again
            request = self.engine.make_request(job.ids, job.params, job.prompt_text, t_start=job.t_start,
                                               **job.options)
            rows[job] = self.engine.submit(request, max_rows=self.max_batch_size)
            new.append(job)
        except Exception as exc:
            self.stats.failed += 1
            job.emit("error", exc)

    def _deliver(self, rows: dict[Job, Any]) -> None:
        for job, handle in list(rows.items()):
            _emit_deltas(job, handle)
            if not handle.finished:
                continue
            del rows[job]
            if handle.error is not None:
                self.stats.failed += 1
                job.emit("error", handle.error)
            elif job.cancelled or handle.result is None:
                self.stats.cancelled += 1
            else:
                self.stats.completed += 1
                job.emit("done", handle.result)


@contextlib.contextmanager
def _first_tokens(rows: list[tuple[Job, Any]]) -> Iterator[None]:
    """While one step prefills several new rows, hand out each row's first token as soon as it exists."""
    done = threading.Event()

    def pump() -> None:
        pending = rows
        while pending and not done.wait(0.005):
            pending = [(job, handle) for job, handle in pending if not _emit_deltas(job, handle)]

    thread = threading.Thread(target=pump, name="kvboost-first-tokens", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _emit_deltas(job: Job, handle: Any) -> bool:
    """Emit what the row has produced since last asked; True when there was any."""
    deltas = handle.take_deltas()
    if deltas and not job.cancelled:
        job.emit("delta", "".join(deltas))
    return bool(deltas)
