"""Before it listens, the server warms up through its own worker (storing nothing) and says what it runs."""
from __future__ import annotations

import pytest

from kvboost.server import BackgroundServer, ServerSettings, create_app
from kvboost.server.__main__ import startup_lines
from kvboost.server.app import warm_up

from .conftest import TINY_NAME


def _stored(engine) -> tuple[int, int]:
    stats = engine.cache_stats()
    return stats["chunks_written"], stats["tiers"]["memory"]["entries"]


@pytest.mark.parametrize("batch", [16, 1])
def test_warm_up_runs_generations_through_the_worker_and_stores_nothing(tiny_engine, batch):
    """A batching server warms up two requests at once (its batched steps are made ready too), a one-at-a-time one
    a single request."""
    app = create_app(tiny_engine, ServerSettings(served_model_name=TINY_NAME, max_batch_size=batch))
    scheduler = app.state.kvboost.scheduler
    before = _stored(tiny_engine)
    by_mode = dict(tiny_engine.cache_stats()["requests_by_mode"])
    try:
        seconds = warm_up(app)
        assert seconds > 0 and scheduler.alive  # the worker keeps running for the requests to come
        runs = 2 if batch > 1 else 1
        assert scheduler.stats.completed == runs and scheduler.stats.failed == 0
        assert scheduler.stats.max_rows_in_a_step == runs  # together, in one batch
        assert _stored(tiny_engine) == before  # baseline mode: no lookup, no write-back
        after = tiny_engine.cache_stats()["requests_by_mode"]
        assert after.get("baseline", 0) == by_mode.get("baseline", 0) + runs
    finally:
        scheduler.stop()


def test_a_warm_up_that_fails_stops_the_start(patchable_engine):
    engine = patchable_engine  # its forwards call model.forward on every device
    app = create_app(engine, ServerSettings(served_model_name=TINY_NAME, max_batch_size=1))

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel for this device")

    engine.model.forward = broken
    try:
        with pytest.raises(RuntimeError, match="no kernel"):
            warm_up(app)
    finally:
        del engine.model.forward
        app.state.kvboost.scheduler.stop()


def test_background_server_can_warm_up_first(tiny_engine):
    app = create_app(tiny_engine, ServerSettings(served_model_name=TINY_NAME))
    with BackgroundServer(app, warm_up=True) as srv:
        assert srv.app.state.kvboost.scheduler.stats.completed == 2  # a batching server warms up two at once


def test_startup_lines_name_device_dtype_context_budgets_times_and_batching(tiny_engine):
    app = create_app(tiny_engine, ServerSettings(served_model_name=TINY_NAME, max_batch_size=8, batch_window_ms=5,
                                                 max_queue=32))
    lines = startup_lines(tiny_engine, app.state.kvboost.settings, app.state.kvboost.scheduler, 1.3, 0.5)
    text = "\n".join(lines)
    assert len(lines) <= 4, text  # a short block, not a log
    dtype = str(tiny_engine.kv_dtype).removeprefix("torch.")
    for expected in (f"model '{TINY_NAME}' on {tiny_engine.device}", dtype,
                     f"context {tiny_engine.max_context:,} tokens", "loaded in 1.3 s", "warmed up in 0.5 s",
                     "memory budget ", "chunks of 16 tokens",
                     "stored at 16 bits", "reuse chunk_kv_reuse", "5 ms window", "queue 32",
                     f"Linear products: {tiny_engine.cpu_linear}"):
        assert expected in text, text
    assert "continuous batching (max 8 rows)" in text or "one request at a time" in text
