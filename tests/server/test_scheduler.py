"""The server's worker loop against the engine's loop contract (submit -> handle, step), with a scripted engine (no
model, no HTTP)."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from kvboost.results import GenerationResult
from kvboost.sampling import SamplingParams
from kvboost.server.scheduler import Job, QueueFullError, Scheduler


@dataclass
class FakeHandle:
    words: list[str]
    max_rows: int | None = None
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


class FakeEngine:
    """Each row emits one word per step. Records which rows each step saw. make_request as the worker calls it: a
    Request-like record of the job. A prompt starting "reject" fails at submit, "mid" fails its row after a word."""

    def __init__(self):
        self.rows: list[FakeHandle] = []
        self.steps: list[list[str]] = []  # first word of every row present at each step
        self.fail_next_step = False

    def make_request(self, ids, params, prompt_text="", **options):
        # The worker hands over the ids the request was validated with; it never re-tokenizes.
        return SimpleNamespace(ids=ids, params=params, prompt_text="".join(map(chr, ids)), **options)

    def submit(self, request, max_rows=None) -> FakeHandle:
        if request.prompt_text.startswith("reject"):
            raise ValueError("bad row")
        handle = FakeHandle(request.prompt_text.split(), max_rows)
        self.rows.append(handle)
        return handle

    def step(self) -> None:
        if self.fail_next_step:  # as the engine's loop does: every running row gets the error, then it raises
            self.fail_next_step = False
            for h in self.rows:
                h.error, h.finished = RuntimeError("step exploded"), True
            self.rows.clear()
            raise RuntimeError("step exploded")
        time.sleep(0.005)  # a step takes time, as a forward pass does
        self.steps.append([h.words[0] if h.words else "" for h in self.rows])
        for h in list(self.rows):
            if h.cancelled:
                h.finished = True
            elif h.words:
                word = h.words.pop(0)
                h._deltas.append(word + " ")
                if word == "mid":
                    h.error, h.finished = RuntimeError("mid-stream failure"), True
            if not h.words and not h.finished:
                h.finished = True
                h.result = GenerationResult("chunk_kv_reuse", "", "done", 0, 0, 0, 0, 0, 1, 0)
            if h.finished:
                self.rows.remove(h)


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
    s = Scheduler(engine=FakeEngine(), max_batch_size=4, batch_window_ms=300, max_queue=8)
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
    engine = scheduler.engine
    assert sorted(engine.steps[0]) == ["a0", "a1", "a2"]  # one batch for the three early requests
    assert all(h.max_rows == 4 for h in engine.rows)  # the server's batch size caps the loop's rows
    assert scheduler.stats.completed == 4 and scheduler.stats.max_rows_in_a_step >= 3


def test_a_bad_row_and_a_failed_step_fail_only_their_requests(scheduler):
    async def main():
        loop = asyncio.get_running_loop()
        scheduler.start()
        bad, good = _job(loop, "reject me"), _job(loop, "fine words")
        scheduler.submit(bad)
        scheduler.submit(good)
        first = await asyncio.gather(_drain(bad), _drain(good))
        scheduler.engine.fail_next_step = True
        doomed = _job(loop, "doomed row")
        scheduler.submit(doomed)
        second = await _drain(doomed)
        after = _job(loop, "after the failure")
        scheduler.submit(after)
        return first, second, await _drain(after)

    (bad, good), doomed, after = asyncio.run(main())
    assert bad[1] == "error:bad row" and good == ("fine words ", "done")
    assert doomed[1] == "error:step exploded"
    assert after == ("after the failure ", "done")  # the loop goes on
    assert scheduler.alive and scheduler.stats.failed == 2


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
    steps = scheduler.engine.steps
    assert len(steps) < 50 and all("never" not in s for s in steps)


def test_requests_beyond_the_batch_size_wait_and_join_as_rows_leave(scheduler):
    async def main():
        loop = asyncio.get_running_loop()
        jobs = [_job(loop, f"r{i} " + " ".join(["x"] * (2 + i))) for i in range(6)]
        for job in jobs:
            scheduler.submit(job)
        scheduler.start()
        return await asyncio.gather(*(_drain(j) for j in jobs))

    results = asyncio.run(main())
    assert [r[1] for r in results] == ["done"] * 6
    steps = scheduler.engine.steps
    assert max(len(s) for s in steps) == 4  # never more rows than max_batch_size
    assert any("r4" in s for s in steps) and "r4" not in steps[0]  # it joined once a row had left


def test_submit_beyond_max_queue_raises_queue_full():
    s = Scheduler(engine=None, max_batch_size=1, max_queue=2)  # worker never started

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


def test_one_at_a_time_the_worker_survives_engine_errors():
    s = Scheduler(FakeEngine(), max_batch_size=1)

    async def main():
        loop = asyncio.get_running_loop()
        s.start()
        jobs = [_job(loop, p) for p in ("reject me", "o mid k", "o k")]
        for j in jobs:
            s.submit(j)
        return await asyncio.gather(*(_drain(j) for j in jobs))

    try:
        out = asyncio.run(main())
    finally:
        s.stop()
    assert out == [("", "error:bad row"), ("o mid ", "error:mid-stream failure"), ("o k ", "done")]
    assert max(len(step) for step in s.engine.steps) == 1


def test_run_here_runs_the_loop_in_the_calling_thread_until_stopped():
    """kvboost serve runs the loop on the main thread (Scheduler.run_here): start() then spawns nothing, requests are
    served by the calling thread, and stop() from another thread ends it without waiting for that thread to exit."""
    import threading

    engine = FakeEngine()
    seen_threads: list[threading.Thread] = []
    step = engine.step
    engine.step = lambda: (seen_threads.append(threading.current_thread()), step())[1]
    s = Scheduler(engine=engine, max_batch_size=2, batch_window_ms=1, max_queue=8)
    caller = threading.Thread(target=s.run_here, name="caller")

    async def main():
        loop = asyncio.get_running_loop()
        caller.start()
        while not s.alive:
            await asyncio.sleep(0.01)
        s.start()  # the app's lifespan calls it: a no-op here
        job = _job(loop, "one two")
        s.submit(job)
        return await _drain(job)

    assert asyncio.run(main()) == ("one two ", "done")
    assert seen_threads and set(seen_threads) == {caller}
    t0 = time.monotonic()
    s.stop()
    assert time.monotonic() - t0 < 2.0
    caller.join(2.0)
    assert not caller.is_alive()


def test_requests_queued_between_run_in_caller_and_run_here_are_served_and_a_stop_is_kept():
    """kvboost serve claims the calling thread before HTTP starts (run_in_caller) and loops later (run_here): a
    request that arrives in between waits for the loop instead of failing, and a stop() in between (HTTP failed
    to start) makes run_here return at once."""
    import threading

    s = Scheduler(engine=FakeEngine(), max_batch_size=2, batch_window_ms=1, max_queue=8)
    claimed, go = threading.Event(), threading.Event()

    def caller():
        s.run_in_caller()
        claimed.set()
        go.wait(5)
        s.run_here()

    thread = threading.Thread(target=caller)

    async def main():
        loop = asyncio.get_running_loop()
        thread.start()
        while not claimed.is_set():
            await asyncio.sleep(0.01)
        s.start()  # the app's lifespan: spawns nothing now
        job = _job(loop, "early bird")
        s.submit(job)
        await asyncio.sleep(0.1)
        assert job.events.empty()  # nobody runs it yet, nobody failed it
        go.set()
        return await _drain(job)

    assert asyncio.run(main()) == ("early bird ", "done")
    s.stop()
    thread.join(2.0)
    assert not thread.is_alive()

    stopped = Scheduler(engine=FakeEngine(), max_batch_size=2, batch_window_ms=1, max_queue=8)
    stopped.run_in_caller()
    threading.Thread(target=stopped.stop).start()  # from another thread, before the loop runs
    time.sleep(0.2)
    t0 = time.monotonic()
    stopped.run_here()  # returns at once: the stop is kept
    assert time.monotonic() - t0 < 1.0
