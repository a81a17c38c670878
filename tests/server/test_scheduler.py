"""The worker loop against the BatchRunner contract, with a scripted runner (no model, no HTTP)."""
from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import ClassVar

import pytest

from kvboost.results import GenerationResult
from kvboost.sampling import SamplingParams
from kvboost.server.scheduler import Job, QueueFullError, Scheduler


@dataclass
class FakeHandle:
    words: list[str]
    finished: bool = False
    result: GenerationResult | None = None
    error: Exception | None = None
    cancelled: bool = False
    _deltas: list[str] = field(default_factory=list)

    def take_deltas(self) -> list[str]:
        out, self._deltas = self._deltas, []
        return out

    def cancel(self) -> None:
        self.cancelled = True


class FakeRunner:
    """Each row emits one word per step. Records which rows each step saw."""

    instances: ClassVar[list[FakeRunner]] = []

    def __init__(self, engine, max_batch_size: int = 16):
        self.rows: list[FakeHandle] = []
        self.steps: list[list[str]] = []  # first word of every row present at each step
        self.fail_next_step = False
        FakeRunner.instances.append(self)

    def add(self, request) -> FakeHandle:
        if request.prompt_text.startswith("reject"):
            raise ValueError("bad row")
        handle = FakeHandle(request.prompt_text.split())
        self.rows.append(handle)
        return handle

    def runs_apart(self, request) -> str | None:
        return "runs alone" if request.prompt_text.startswith("apart") else None

    def has_work(self) -> bool:
        return bool(self.rows)

    def step(self) -> None:
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("step exploded")
        time.sleep(0.005)  # a step takes time, as a forward pass does
        self.steps.append([h.words[0] if h.words else "" for h in self.rows])
        for h in list(self.rows):
            if h.cancelled:
                h.finished = True
            elif h.words:
                h._deltas.append(h.words.pop(0) + " ")
            if not h.words and not h.finished:
                h.finished = True
                h.result = GenerationResult("chunk_kv_reuse", "", "done", 0, 0, 0, 0, 0, 1, 0)
            if h.finished:
                self.rows.remove(h)


class RequestMaker:
    """The engine's make_request as the worker calls it: a Request-like record of the job; and its stream (the
    single-request path, for requests the runner runs apart): one word per step, recorded in `log`."""

    def __init__(self):
        self.log: list[str] = []

    def make_request(self, ids, params, prompt_text="", **options):
        return SimpleNamespace(ids=ids, params=params, prompt_text=prompt_text, **options)

    def stream(self, request):
        log = self.log

        class Stream:
            result = GenerationResult("chunk_kv_reuse", request.prompt_text, "alone", 1, 0, 0, 0, 0, 1, 0)

            def __iter__(self):
                for word in request.prompt_text.split():
                    time.sleep(0.005)
                    log.append(word)
                    yield word + " "

            def close(self):
                pass

        return Stream()


def _job(loop, text: str) -> Job:
    return Job([ord(c) for c in text], SamplingParams(max_new_tokens=4), text, loop)


async def _drain(job: Job) -> tuple[str, str]:
    text, last = "", ""
    async for kind, payload in job.stream():
        if kind == "delta":
            text += payload
        last = kind if kind != "error" else f"error:{payload}"
    return text, last


@pytest.fixture
def scheduler():
    FakeRunner.instances.clear()
    s = Scheduler(engine=RequestMaker(), max_batch_size=4, batch_window_ms=300, max_queue=8, runner_factory=FakeRunner)
    yield s
    s.stop()


def test_requests_in_the_window_start_together_and_later_ones_join(scheduler):
    async def main():
        loop = asyncio.get_running_loop()
        early = [_job(loop, f"a{i} x y z") for i in range(3)]
        for job in early:
            scheduler.submit(job)
        scheduler.start()
        await asyncio.sleep(0.5)  # past the window: the first batch is running (or done)
        late = _job(loop, "late x")
        scheduler.submit(late)
        return await asyncio.gather(*(_drain(j) for j in early + [late]))

    results = asyncio.run(main())
    assert [r[1] for r in results] == ["done"] * 4
    assert results[0][0] == "a0 x y z "
    runner = FakeRunner.instances[0]
    assert sorted(runner.steps[0]) == ["a0", "a1", "a2"]  # one batch for the three early requests
    assert scheduler.stats.completed == 4 and scheduler.stats.max_rows >= 3


def test_a_bad_row_and_a_failed_step_fail_only_their_requests(scheduler):
    async def main():
        loop = asyncio.get_running_loop()
        scheduler.start()
        bad, good = _job(loop, "reject me"), _job(loop, "fine words")
        scheduler.submit(bad)
        scheduler.submit(good)
        first = await asyncio.gather(_drain(bad), _drain(good))
        FakeRunner.instances[-1].fail_next_step = True
        doomed = _job(loop, "doomed row")
        scheduler.submit(doomed)
        second = await _drain(doomed)
        after = _job(loop, "after the failure")
        scheduler.submit(after)
        return first, second, await _drain(after)

    (bad, good), doomed, after = asyncio.run(main())
    assert bad[1] == "error:bad row" and good == ("fine words ", "done")
    assert doomed[1] == "error:step exploded"
    assert after == ("after the failure ", "done")  # a fresh runner took over
    assert len(FakeRunner.instances) == 2 and scheduler.alive


def test_cancelled_rows_leave_and_queued_cancelled_jobs_are_dropped(scheduler):
    async def main():
        loop = asyncio.get_running_loop()
        long = _job(loop, " ".join(["w"] * 200))
        queued = _job(loop, "never runs")
        queued.cancel()
        scheduler.submit(queued)
        scheduler.submit(long)
        scheduler.start()
        async for kind, _ in long.stream():
            if kind == "delta":
                break
        long.cancel()
        for _ in range(200):
            if scheduler.active_count() == 0 and scheduler.stats.cancelled == 2:
                break
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert scheduler.stats.cancelled == 2 and scheduler.stats.completed == 0
    steps = FakeRunner.instances[0].steps
    assert len(steps) < 50 and all("never" not in s for s in steps)


def test_a_request_the_runner_cannot_batch_runs_alone_once_the_batch_drains(scheduler):
    """Admission pauses behind it (arrival order): rows already running finish, it runs through the single-request
    path, then batching resumes with whoever queued meanwhile."""
    async def main():
        loop = asyncio.get_running_loop()
        first = [_job(loop, f"b{i} x y z") for i in range(2)]
        alone, cancelled = _job(loop, "apart one two"), _job(loop, "apart never")
        after = _job(loop, "c0 x")
        for job in (*first, alone, cancelled, after):
            scheduler.submit(job)
        cancelled.cancel()
        scheduler.start()
        return await asyncio.gather(*(_drain(j) for j in (*first, alone, after)))

    results = asyncio.run(main())
    assert results == [("b0 x y z ", "done"), ("b1 x y z ", "done"), ("apart one two ", "done"), ("c0 x ", "done")]
    runner = FakeRunner.instances[0]
    assert sorted(runner.steps[0]) == ["b0", "b1"] and all("c0" not in s for s in runner.steps[:4])
    assert scheduler.engine.log == ["apart", "one", "two"]  # never batched, never the cancelled one
    assert any("c0" in s for s in runner.steps)  # batching resumed after it
    assert scheduler.stats.run_apart == 1 and scheduler.stats.cancelled == 1 and scheduler.stats.completed == 4


def test_submit_beyond_max_queue_raises_queue_full():
    s = Scheduler(engine=None, max_batch_size=1, max_queue=2, runner_factory=None)  # worker never started

    async def main():
        loop = asyncio.get_running_loop()
        s._stop.set()  # keep submit from starting a worker, so the queue only fills
        s.submit(_job(loop, "one"))
        s.submit(_job(loop, "two"))
        with pytest.raises(QueueFullError) as info:
            s.submit(_job(loop, "three"))
        return info.value.retry_after

    assert asyncio.run(main()) >= 1
    assert s.stats.rejected == 1


def test_single_mode_worker_survives_engine_errors():
    class Engine(RequestMaker):
        calls = 0

        def stream(self, request):
            # The worker hands over the ids the request was validated with; it never re-tokenizes.
            Engine.calls += 1
            prompt = "".join(map(chr, request.ids))
            if prompt.startswith("boom"):
                raise RuntimeError("engine exploded")
            raise_mid = prompt.startswith("mid")

            class Stream:
                result = GenerationResult("chunk_kv_reuse", prompt, "ok", 1, 0, 0, 0, 0, 1, 0)

                def __iter__(self):
                    yield "o"
                    if raise_mid:
                        raise RuntimeError("mid-stream failure")
                    yield "k"

                def close(self):
                    pass

            return Stream()

    s = Scheduler(Engine(), max_batch_size=1, runner_factory=None, tokenizer_lock=threading.Lock())

    async def main():
        loop = asyncio.get_running_loop()
        s.start()
        jobs = [_job(loop, p) for p in ("boom", "mid", "fine")]
        for j in jobs:
            s.submit(j)
        return await asyncio.gather(*(_drain(j) for j in jobs))

    try:
        out = asyncio.run(main())
    finally:
        s.stop()
    assert out == [("", "error:engine exploded"), ("o", "error:mid-stream failure"), ("ok", "done")]
