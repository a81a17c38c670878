"""`kvboost serve --replicas N` on Ray Serve: N replicas, each `kvboost serve`'s app over its own engine, behind one
ingress on the same port and paths. Ray places, restarts and scales the replicas and runs the HTTP proxy; KVBoost
adds the router (cluster/router.py), what each replica reports to it, and the ingress that keys requests.

    client -> Ray's HTTP proxy -> Ingress (keys the prompt's chunks) -> KVBoostRouter -> Replica (the server's app)
"""
# No `from __future__ import annotations`: Ray Serve's ingress resolves the route's annotations at run time.
import asyncio
import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from ray import serve
from ray.exceptions import RayError
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from ..server.errors import APIError
from ..server.kv_events import KVEventPublisher
from .asgi import HttpRequest, ResponseStart, call
from .held_keys import HeldKeys
from .keying import Recipe, RequestKeying
from .metrics import merge_expositions
from .router import KVBoostRouter, RoundRobinRouter, RoutedRequest

logger = logging.getLogger("kvboost.cluster")

REPLICA_HEADER = "x-kvboost-replica"
_HOP_HEADERS = {b"content-length", b"transfer-encoding", b"connection"}
_RESPONSE_ID = re.compile(rb'"id"\s*:\s*"(resp_[A-Za-z0-9_-]+)"')
_RESPONSE_PATH = re.compile(rb"^/v1/responses/(resp_[A-Za-z0-9_-]+)")
_PREVIOUS_RESPONSE = re.compile(rb'"previous_response_id"\s*:\s*"([^"]+)"')


@dataclass(frozen=True)
class ReplicaSpec:
    """What every replica builds: `kvboost serve`'s settings, KVBoost.from_pretrained's keywords, prompts to warm."""

    settings: Any  # server.settings.ServerSettings
    load: dict[str, Any] = field(default_factory=dict)
    warm: list[list[dict]] = field(default_factory=list)


def _per_replica(spec: ReplicaSpec, rank: int) -> ReplicaSpec:
    """A replica's own disk directory and KV-event endpoint (numbered by rank, so a restarted replica finds its
    predecessor's chunks on disk); a Redis tier stays shared."""
    load, settings = dict(spec.load), spec.settings
    if load.get("disk_cache_dir"):
        load["disk_cache_dir"] = f"{load['disk_cache_dir']}/replica-{rank}"
    if settings.kv_events:
        settings = replace(settings, kv_events=_endpoint_for(settings.kv_events, rank))
    return replace(spec, load=load, settings=settings)


def _endpoint_for(endpoint: str, rank: int) -> str:
    """tcp://host:5557 -> port 5557 + rank; any other endpoint gets a '.rank' suffix (ipc://path.1)."""
    match = re.fullmatch(r"(tcp://.*):(\d+)", endpoint)
    return f"{match[1]}:{int(match[2]) + rank}" if match else f"{endpoint}.{rank}"


@serve.deployment(name="kvboost-replica")
class Replica:
    """One engine and the server's app. The engine is loaded, and its loop runs, on one thread of its own: the thread
    that loads a model on a CPU keeps the OpenMP team its steps need (server/__main__.py runs the loop where it loaded
    for the same reason)."""

    async def __init__(self, spec: ReplicaSpec):
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        context = serve.get_replica_context()
        self.name = context.replica_id.unique_id
        spec = _per_replica(spec, context.rank.rank)
        loaded: Future[None] = Future()

        def engine_thread() -> None:
            try:
                self._load(spec)
            except BaseException as exc:  # reported by __init__, which Ray then retries
                loaded.set_exception(exc)
                return
            loaded.set_result(None)
            self.scheduler.run_here()

        threading.Thread(target=engine_thread, name="kvboost-engine", daemon=True).start()
        await asyncio.to_thread(loaded.result)  # raises what the load raised
        from ..server.app import warm_up

        await asyncio.to_thread(warm_up, self.app)

    def _load(self, spec: ReplicaSpec) -> None:
        from .. import KVBoost
        from ..server.app import create_app

        self.engine = KVBoost.from_pretrained(spec.settings.model, **spec.load)
        for messages in spec.warm:
            self.engine.warm(messages=messages)
        events = spec.settings.kv_events
        self.publisher = KVEventPublisher(events, self.engine.config.chunk_size) if events else None
        self.held = HeldKeys(also=self.publisher)
        self.engine.store.watch(self.held, "GPU" if self.engine.device.type == "cuda" else "CPU")
        self.app = create_app(self.engine, replace(spec.settings, kv_events=None))  # events: self.held tells them
        self.scheduler = self.app.state.kvboost.scheduler
        self.scheduler.run_in_caller()  # the loop is this thread's, from here on

    def recipe(self) -> Recipe:
        return Recipe.of(self.engine)

    async def handle(self, request: RoutedRequest) -> AsyncIterator[ResponseStart | bytes]:
        async for piece in call(self.app, request.http):
            if isinstance(piece, ResponseStart):
                piece = ResponseStart(piece.status, [*piece.headers, (REPLICA_HEADER.encode(), self.name.encode())])
            yield piece

    async def record_routing_stats(self) -> dict[str, Any]:
        return {"queued": self.scheduler.queue_depth() + self.scheduler.active_count(), **self.held.report()}

    def check_health(self) -> None:
        if not self.scheduler.alive:
            raise RuntimeError("the engine's loop has stopped")

    def __del__(self) -> None:
        scheduler = getattr(self, "scheduler", None)
        if scheduler is not None:
            scheduler.stop()
            self.engine.flush()
            if self.publisher is not None:
                self.publisher.close()


# Module-level helpers the ingress uses are defined above it: serve.ingress captures the class as it is defined.
def _stream_error(path: str, message: str) -> bytes:
    if path == "/v1/responses":
        event = {"type": "error", "code": "replica_failed", "message": message, "param": None}
        return f"event: error\ndata: {json.dumps(event)}\n\n".encode()
    return f"data: {json.dumps(APIError(500, message, code='replica_failed').body())}\n\n".encode()


ingress_app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)


@serve.deployment(name="kvboost-ingress")
@serve.ingress(ingress_app)
class Ingress:
    """Keys each generation request's prompt and hands it to the replicas' router; relays the replica's response.
    A replica that fails before answering is retried once (the router then knows it is gone); one that fails while
    streaming ends the stream with an error event, never a hang."""

    def __init__(self, replicas: DeploymentHandle, pinned_responses: int = 16384):
        self.replicas = replicas
        self.keying: RequestKeying | None = None
        self.pins: OrderedDict[str, str] = OrderedDict()  # stored response id -> the replica that stored it
        self.max_pins = pinned_responses
        self.seen: set[str] = set()  # replicas that have answered (their /metrics are merged)
        # One thread: a fast tokenizer shared between threads can fail ("Already borrowed").
        self.tokenizing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvboost-keying")

    @ingress_app.api_route("/{path:path}", methods=["GET", "POST", "DELETE"])
    async def forward(self, request: Request) -> Response:
        body = await request.body()
        client = (request.client.host, request.client.port) if request.client else ("127.0.0.1", 0)
        http = HttpRequest(request.method, request.url.path, request.url.query.encode(), list(request.headers.raw),
                           body, client)
        if http.method == "GET" and http.path == "/metrics" and self.seen:
            return await self._metrics(http)
        keys = None
        if http.method == "POST":  # tokenized off the event loop (a long prompt takes milliseconds), one at a time
            if self.keying is None:
                self.keying = RequestKeying(await self.replicas.recipe.remote())
            keys = await asyncio.get_running_loop().run_in_executor(self.tokenizing, self.keying.keys, http.path, body)
        routed = RoutedRequest(http, keys, self._pin(http))
        for attempt in range(2):
            stream = self.replicas.options(stream=True).handle.remote(routed)
            try:
                start = await stream.__anext__()
                break
            except RayError as exc:
                if attempt:
                    return APIError(503, f"no replica could serve the request: {type(exc).__name__}",
                                    code="replica_unavailable").response()
                logger.warning("a replica failed before answering (%s); retrying on another", type(exc).__name__)
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in start.headers if k.lower() not in _HOP_HEADERS}
        replica = headers.get(REPLICA_HEADER)
        if replica is not None:
            self.seen.add(replica)
        if not headers.get("content-type", "").startswith("text/event-stream"):
            try:
                content = b"".join([piece async for piece in stream])
            except RayError as exc:
                return APIError(503, f"the replica failed while answering: {type(exc).__name__}",
                                code="replica_unavailable").response()
            self._remember(http, content, replica)
            return Response(content, start.status, headers)
        return StreamingResponse(self._relay(http, stream, replica), start.status, headers)

    async def _relay(self, http: HttpRequest, stream, replica: str | None) -> AsyncIterator[bytes]:
        try:
            async for piece in stream:
                self._remember(http, piece, replica)  # the first piece names a stored response (later ones agree)
                yield piece
        except Exception as exc:  # the replica died (RayError), or Serve gave up on it: the client must hear
            logger.warning("a replica failed while streaming: %s: %s", type(exc).__name__, exc)
            yield _stream_error(http.path, f"the replica serving this stream failed ({type(exc).__name__}); "
                                           "the output so far is incomplete")

    async def _metrics(self, http: HttpRequest) -> Response:
        """Every replica that has answered, asked by pin; one that another replica answered for is gone."""
        texts: dict[str, str] = {}
        for replica in sorted(self.seen):
            try:
                pieces = [p async for p in self.replicas.options(stream=True).handle.remote(
                    RoutedRequest(http, None, replica))]
            except RayError:
                continue
            answered = dict(pieces[0].headers).get(REPLICA_HEADER.encode(), b"").decode()
            if answered != replica:
                self.seen.discard(replica)
                continue
            texts[replica] = b"".join(pieces[1:]).decode()
        return Response(merge_expositions(texts), 200, media_type=CONTENT_TYPE_LATEST)

    def _pin(self, http: HttpRequest) -> str | None:
        """The replica a request asks for by name (an `x-kvboost-replica` header: one replica's /v1/stats or /health),
        else the one holding the stored response it reads (previous_response_id, GET / DELETE by id)."""
        asked = dict(http.headers).get(REPLICA_HEADER.encode())
        if asked:
            return asked.decode("latin-1")
        found = _RESPONSE_PATH.match(http.path.encode()) or (
            http.path == "/v1/responses" and _PREVIOUS_RESPONSE.search(http.body))
        return self.pins.get(found[1].decode()) if found else None

    def _remember(self, http: HttpRequest, head: bytes, replica: str | None) -> None:
        if replica is None or http.method != "POST" or http.path != "/v1/responses":
            return
        found = _RESPONSE_ID.search(head)
        if found:
            self.pins[found[1].decode()] = replica
            while len(self.pins) > self.max_pins:
                self.pins.popitem(last=False)


# KVBoostRouter, Ray Serve's default (power of two choices) or RoundRobinRouter: the last two for comparisons.
ROUTERS = ("kvboost", "power-of-two", "round-robin")


def build_app(spec: ReplicaSpec, replicas: int, imbalance: int = 4, gpus_per_replica: float = 0.0,
              cpus_per_replica: float = 1.0, stats_period_s: float = 1.0, router: str = "kvboost"):
    """The Ray Serve application: `replicas` engines behind the ingress, routed by KVBoostRouter (or Ray's own
    power-of-two-choices router, `router="power-of-two"`, or RoundRobinRouter, `router="round-robin"`)."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    if router not in ROUTERS:
        raise ValueError(f"router must be one of {ROUTERS}, got {router!r}")
    batch = spec.settings.max_batch_size
    # By import path: a class object would travel pickled by value, with a copy of RoutedRequest that the ingress's
    # requests are not instances of.
    chosen = {"kvboost": {"request_router_class": f"{KVBoostRouter.__module__}:{KVBoostRouter.__name__}",
                          "request_router_kwargs": {"imbalance": imbalance}},
              "round-robin": {"request_router_class": f"{RoundRobinRouter.__module__}:{RoundRobinRouter.__name__}"},
              }.get(router, {})
    router = RequestRouterConfig(**chosen, request_routing_stats_period_s=stats_period_s,
                                 request_routing_stats_timeout_s=max(5.0, stats_period_s))
    # A replica takes a batch and as many waiting: the rest wait in Ray's router, which can still send them elsewhere.
    engine = Replica.options(num_replicas=replicas, max_ongoing_requests=2 * batch, request_router_config=router,
                             ray_actor_options={"num_cpus": cpus_per_replica, "num_gpus": gpus_per_replica},
                             health_check_period_s=5.0)
    return Ingress.options(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=4096).bind(engine.bind(spec))


def build(args: dict[str, Any]):
    """Application builder for a Ray Serve config file (`import_path: kvboost.cluster.deploy:build`), args:
    replicas, imbalance, server ({ServerSettings fields}), engine ({KVBoost.from_pretrained keywords}), warm
    (lists of chat messages), gpus_per_replica, cpus_per_replica, router (one of ROUTERS)."""
    from ..server.settings import ServerSettings

    casts = {"replicas": int, "imbalance": int, "gpus_per_replica": float, "cpus_per_replica": float, "router": str}
    known = {"server", "engine", "warm", *casts}
    unknown = sorted(set(args) - known)
    if unknown:
        raise ValueError(f"unknown args {unknown}: expected some of {sorted(known)}")
    spec = ReplicaSpec(ServerSettings(**args.get("server", {})), dict(args.get("engine", {})),
                       list(args.get("warm", [])))
    return build_app(spec, **{"replicas": 1, **{k: cast(args[k]) for k, cast in casts.items() if k in args}})
