"""The FastAPI app: OpenAI-compatible routes over one engine and its scheduler."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import importlib.util
import json
import logging
import math
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from .. import __version__
from ..results import GenerationMode, GenerationResult
from ..sampling import SamplingParams
from . import access_log
from .errors import APIError, ModelT, install_error_handlers, invalid, to_api_error, unsupported, validated
from .metrics import ServerMetrics
from .prepare import Prepared, prepare_chat, prepare_completion
from .render import ChatRenderer, CompletionRenderer, Renderer, model_card
from .responses import ResponseRenderer, ResponseStore, to_chat
from .scheduler import Job, QueueFullError, Scheduler
from .schema import ChatCompletionRequest, CompletionRequest, ResponsesRequest, TokenizeRequest
from .settings import ServerSettings

log = logging.getLogger("kvboost.server")

_DISCONNECT_POLL_S = 0.5  # non-streaming requests check this often whether their client is still there
_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/tokenize", "/v1/models", "/v1/stats",
           "/health", "/metrics")
_WARM_UP_MESSAGES = [{"role": "user", "content": "Hello! Who are you?"}]


@dataclass
class ServerState:
    engine: Any
    settings: ServerSettings
    scheduler: Scheduler
    metrics: ServerMetrics
    started: int
    responses: ResponseStore = dataclasses.field(default_factory=ResponseStore)  # for previous_response_id


def create_app(engine, settings: ServerSettings | None = None, scheduler: Scheduler | None = None) -> FastAPI:
    """The app for an engine that is already loaded. The scheduler's worker runs while the app is up."""
    settings = settings or ServerSettings()
    scheduler = scheduler or Scheduler(engine, settings.max_batch_size, settings.batch_window_ms, settings.max_queue)
    metrics = ServerMetrics(scheduler.queue_depth, scheduler.active_count, lambda: _cache_stats(engine),
                            settings.model_id)
    state = ServerState(engine, settings, scheduler, metrics, int(time.time()))
    events = None  # the KV-event publisher, listening to the engine's store
    if settings.kv_events is not None:
        from .kv_events import KVEventPublisher

        events = KVEventPublisher(settings.kv_events, engine.config.chunk_size)
        engine.store.watch(events, "GPU" if engine.device.type == "cuda" else "CPU")

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        scheduler.start()
        try:
            yield
        finally:
            await asyncio.to_thread(scheduler.stop)
            # Chunks written behind to disk / Redis land before the process goes (bounded by flush_timeout_s).
            await asyncio.to_thread(engine.flush)
            if events is not None:
                engine.store.watch(None, "")
                events.close()

    app = FastAPI(title="KVBoost", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.kvboost = state
    install_error_handlers(app)
    app.add_middleware(GatewayMiddleware, settings=settings, metrics=metrics)
    _add_routes(app, state)
    return app


def warm_up(app: FastAPI, max_new_tokens: int = 4, timeout_s: float = 600.0) -> float:
    """Run short greedy chats (two at once when batching) through the scheduler so one-time costs are paid before
    listening (BASELINE: nothing cached); returns the seconds. Raises what a generation raised."""
    state: ServerState = app.state.kvboost
    t0 = time.perf_counter()
    if importlib.util.find_spec("xgrammar") is not None and hasattr(type(state.engine), "grammars"):
        _ = state.engine.grammars  # the grammar library's vocabulary preprocessing, before listening
    with state.scheduler.tokenizer_lock:
        ids = state.engine.encode(messages=_WARM_UP_MESSAGES)
        text = state.engine.tokenizer.decode(ids)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    state.scheduler.start()

    async def run_to_end() -> None:
        jobs = [Job(ids, params, text, asyncio.get_running_loop(), {"mode": GenerationMode.BASELINE})
                for _ in range(2 if state.scheduler.batched else 1)]
        for job in jobs:
            state.scheduler.submit(job)
        try:
            await asyncio.wait_for(asyncio.gather(*(_result(job) for job in jobs)), timeout_s)
        finally:
            for job in jobs:
                job.cancel()  # a no-op once done; stops the worker's generation after a timeout

    asyncio.run(run_to_end())
    return time.perf_counter() - t0


async def _result(job: Job) -> GenerationResult | None:
    """The job's result; raises what its generation raised."""
    async for kind, payload in job.stream():
        if kind == "error":
            raise payload
    return job.result


class GatewayMiddleware:
    """Bearer-token check on /v1 routes (when an API key is set), request counting by route and status, and the access
    log line (when asked)."""

    def __init__(self, app: ASGIApp, settings: ServerSettings, metrics: ServerMetrics):
        self.app, self.settings, self.metrics = app, settings, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope.get("path", "")
        route = next((r for r in _ROUTES if path == r or path.startswith(r + "/")), "other")
        status = 500

        async def counting_send(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        tally, t0 = access_log.open_tally() if self.settings.access_log else None, time.perf_counter()
        try:
            if self.settings.api_key and path.startswith("/v1") and not self._authorized(scope):
                await APIError(401, "Incorrect or missing API key. Send it as 'Authorization: Bearer <key>'.",
                               code="invalid_api_key").response()(scope, receive, counting_send)
                return
            await self.app(scope, receive, counting_send)
        finally:
            self.metrics.requests.labels(route, str(status)).inc()
            if tally is not None:
                access_log.write(scope.get("method", ""), path, status, (time.perf_counter() - t0) * 1e3, tally)

    def _authorized(self, scope: Scope) -> bool:
        scheme, _, token = Headers(scope=scope).get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(),
                                                                  str(self.settings.api_key).encode())


def _add_routes(app: FastAPI, state: ServerState) -> None:
    settings, scheduler, metrics, lock = state.settings, state.scheduler, state.metrics, state.scheduler.tokenizer_lock

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = scheduler.alive
        body = {"status": "ok" if ok else "unhealthy", "model": settings.model_id, "worker_alive": ok,
                "queued": scheduler.queue_depth(), "active": scheduler.active_count()}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [model_card(settings.model_id, state.started)]}

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str) -> dict:
        _check_model(settings, model)
        return model_card(settings.model_id, state.started)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        """vLLM's tokenizer endpoint, which routers (vllm-router's kv_aware policy) call to key a request."""
        req = await parse_body(request, TokenizeRequest)
        if (req.prompt is None) == (req.messages is None):
            raise invalid("send exactly one of prompt and messages", "prompt")
        with lock:
            ids = state.engine.encode(prompt=req.prompt, messages=req.messages,
                                      add_generation_prompt=req.add_generation_prompt)
        return {"count": len(ids), "max_model_len": state.engine.max_context, "tokens": ids, "token_strs": None}

    @app.get("/v1/stats")
    async def stats() -> JSONResponse:
        body: dict[str, Any] = {"model": settings.model_id, "mode": settings.mode.value}
        try:
            body["scheduler"] = scheduler.snapshot()
        except Exception as exc:
            body["scheduler"] = {"error": f"{type(exc).__name__}: {exc}"}
        body["cache"] = _cache_stats(state.engine)
        return JSONResponse(_json_safe(body))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        t0 = time.perf_counter()
        req = await parse_body(request, ChatCompletionRequest)
        _check_model(settings, req.model)
        prepared = prepare_chat(state.engine, req, lock)
        renderer = ChatRenderer(settings.model_id, _decoder(state), prepared.n, prepared.tool_parse, prepared.predicted)
        return await _respond(state, prepared, renderer, req.cache_salt, request, t0)

    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        t0 = time.perf_counter()
        req = await parse_body(request, ResponsesRequest)
        _check_model(settings, req.model)
        chat, conversation = to_chat(req, state.responses)
        prepared = prepare_chat(state.engine, chat, lock)
        if prepared.n != 1:
            raise unsupported("n is a chat completions parameter", "n")
        renderer = ResponseRenderer(settings.model_id, req, conversation, state.responses, prepared.tool_parse)
        return await _respond(state, prepared, renderer, chat.cache_salt, request, t0)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> dict:
        return state.responses.get(response_id)[0]

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> dict:
        state.responses.delete(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        t0 = time.perf_counter()
        req = await parse_body(request, CompletionRequest)
        _check_model(settings, req.model)
        prepared = prepare_completion(state.engine, req, settings, lock)
        renderer = CompletionRenderer(settings.model_id, _decoder(state), prepared.n)
        return await _respond(state, prepared, renderer, req.cache_salt, request, t0)


def _decoder(state: ServerState):
    def decode(token: int) -> str:
        with state.scheduler.tokenizer_lock:
            return state.engine.tokenizer.decode([token])
    return decode


MAX_BODY_BYTES = 64 << 20  # a request's JSON: far above any context window's text
MAX_JSON_DEPTH = 64  # nesting levels: a chat body with tools and JSON schemas needs a few dozen


async def parse_body(request: Request, model: type[ModelT]) -> ModelT:
    """The JSON body as `model`, whatever the Content-Type says (curl -d sends form encoding); 400 otherwise. A body
    too large or nested too deep is refused before anything recursive reads it: a 400, and the connection stays
    usable (an exception escaping the app makes the server close it)."""
    raw = bytearray()
    async for part in request.stream():
        raw += part
        if len(raw) > MAX_BODY_BYTES:
            raise APIError(400, f"the request body is over {MAX_BODY_BYTES >> 20} MiB", code="request_too_large")
    if not raw.strip():
        raise APIError(400, "the request body is empty; send a JSON object", code="invalid_json")
    try:
        data = json.loads(raw)
        too_deep = json_depth(data) > MAX_JSON_DEPTH  # deeper than recursive readers (validation) should go
    except RecursionError:  # deeper than the parser goes
        too_deep = True
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(400, f"could not parse the JSON body: {exc}", code="invalid_json") from None
    if too_deep:
        raise APIError(400, f"the JSON body nests objects and arrays more than {MAX_JSON_DEPTH} levels deep",
                       code="invalid_json")
    if not isinstance(data, dict):
        raise APIError(400, f"the JSON body must be an object, got {type(data).__name__}", code="invalid_json")
    return validated(model, data)


def json_depth(value: Any) -> int:
    """How deeply a parsed JSON value nests objects and arrays, read without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is not None:
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in children)
    return deepest


def _check_model(settings: ServerSettings, name: str) -> None:
    if not settings.accepts_model(name):
        raise APIError(404, f"The model '{name}' does not exist. This server serves '{settings.model_id}'.",
                       param="model", code="model_not_found")


async def _respond(state: ServerState, prepared: Prepared, renderer: Renderer | ResponseRenderer,
                   salt: str | None, request: Request, t0: float) -> Response:
    # n choices: n rows of one prompt submitted together, so its K/V is computed once. Choice i gets seed + i.
    options = dict(cache_salt=salt, mode=prepared.mode or state.settings.mode, content_reuse=prepared.content_reuse,
                   output_format=prepared.output_format, speculative=prepared.speculative)
    seed = prepared.params.seed
    jobs = [Job(prepared.ids, prepared.params if i == 0 or seed is None else
                dataclasses.replace(prepared.params, seed=seed + i), prepared.prompt_text, asyncio.get_running_loop(),
                options, t0) for i in range(prepared.n)]

    def cancel_all() -> None:
        for job in jobs:
            job.cancel()

    try:
        for job in jobs:
            state.scheduler.submit(job)
    except QueueFullError as exc:
        cancel_all()
        state.metrics.outcomes.labels(renderer.endpoint, "rejected").inc()
        raise to_api_error(exc) from None
    if prepared.stream:
        return StreamingResponse(_sse(state, jobs, renderer, prepared.include_usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                                 background=BackgroundTask(cancel_all))  # runs after a disconnect as well
    try:
        results = await asyncio.gather(*(_collect(state, job, renderer, request) for job in jobs))
    finally:
        cancel_all()  # a no-op for finished jobs; stops the others when one failed
    return JSONResponse(renderer.full(list(results)))


async def _collect(state: ServerState, job: Job, renderer: Renderer | ResponseRenderer,
                   request: Request) -> GenerationResult:
    """Wait for a non-streaming request's result; cancel it if the client goes away meanwhile."""
    metrics, endpoint = state.metrics, renderer.endpoint
    first = True
    next_check = time.perf_counter() + _DISCONNECT_POLL_S
    try:
        while True:
            try:
                kind, payload = await asyncio.wait_for(job.events.get(), _DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                kind, payload = "wait", None
            if time.perf_counter() >= next_check:  # deltas may keep coming; look at the client anyway
                next_check = time.perf_counter() + _DISCONNECT_POLL_S
                if await request.is_disconnected():
                    raise APIError(499, "client closed the request", code="client_closed")
            if kind == "wait":
                continue
            if first:
                metrics.observe_ttft(endpoint, time.perf_counter() - job.t_start)
                first = False
            if kind == "delta":
                continue
            job.finished = True
            if kind == "error":
                metrics.outcomes.labels(endpoint, "error").inc()
                raise to_api_error(payload)
            metrics.observe_latency(endpoint, time.perf_counter() - job.t_start)
            metrics.observe_result(endpoint, payload)
            access_log.count(payload)
            return payload
    finally:
        if not job.finished:
            job.cancel()
            metrics.outcomes.labels(endpoint, "cancelled").inc()


async def _merged(jobs: list[Job]) -> AsyncIterator[tuple[int, str, Any]]:
    """(choice index, kind, payload) from every job, as they come, until each has ended."""
    events: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, job: Job) -> None:
        async for kind, payload in job.stream():
            await events.put((i, kind, payload))

    tasks = [asyncio.create_task(pump(i, job)) for i, job in enumerate(jobs)]
    try:
        left = len(jobs)
        while left:
            i, kind, payload = await events.get()
            left -= kind != "delta"
            yield i, kind, payload
    finally:
        for task in tasks:
            task.cancel()


async def _sse(state: ServerState, jobs: list[Job], renderer: Renderer | ResponseRenderer,
               include_usage: bool) -> AsyncIterator[str]:
    """Role, content / tool-call and final chunks, usage if asked, [DONE]; an error ends the stream."""
    metrics, endpoint = state.metrics, renderer.endpoint
    first = True
    results: list[GenerationResult | None] = [None] * len(jobs)
    t_start = jobs[0].t_start
    try:
        for chunk in renderer.head():
            yield renderer.frame(chunk)
        async with contextlib.aclosing(_merged(jobs)) as events:
            async for index, kind, payload in events:
                if first:
                    metrics.observe_ttft(endpoint, time.perf_counter() - t_start)
                    first = False
                if kind == "delta":
                    for chunk in renderer.delta(payload, index):
                        yield renderer.frame(chunk)
                elif kind == "done":
                    results[index] = payload
                    metrics.observe_result(endpoint, payload)
                    access_log.count(payload)
                    for chunk in renderer.final(payload, index):
                        yield renderer.frame(chunk)
                else:  # the headers are out: the error travels in the stream, where the OpenAI SDK raises it
                    metrics.outcomes.labels(endpoint, "error").inc()
                    log.warning("request failed mid-stream: %r", payload)
                    yield renderer.frame(renderer.error(to_api_error(payload).body()))
                    break
        if all(r is not None for r in results):
            metrics.observe_latency(endpoint, time.perf_counter() - t_start)
            if include_usage:
                yield renderer.frame(renderer.usage(results))  # type: ignore[arg-type, union-attr]
        if renderer.done:
            yield renderer.done
    finally:
        for job in jobs:
            if not job.finished:  # the client went away (or a sibling choice failed): stop generating for it
                job.cancel()
                metrics.outcomes.labels(endpoint, "cancelled").inc()


def _json_safe(value: Any) -> Any:
    """Plain JSON: non-finite floats become null, unknown objects their str()."""
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_json_safe(v) for v in value]
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (str, int, bool)):
        return value
    return str(value)


def _cache_stats(engine) -> dict:
    """engine.cache_stats(), retried (the worker may be mutating a store), and never an exception."""
    for _ in range(3):
        try:
            return dict(engine.cache_stats())
        except Exception as exc:
            error = exc
    return {"error": f"cache statistics unavailable: {type(error).__name__}: {error}"}
