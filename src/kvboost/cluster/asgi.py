"""One HTTP request through an ASGI app in this process, its response yielded as the app sends it: how a replica runs
`kvboost serve`'s app (server/app.py) unchanged behind the cluster's ingress (cluster/deploy.py)."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

Headers = list[tuple[bytes, bytes]]
log = logging.getLogger("kvboost.cluster")


@dataclass(frozen=True)
class HttpRequest:
    method: str
    path: str
    query: bytes = b""
    headers: Headers = field(default_factory=list)
    body: bytes = b""
    client: tuple[str, int] = ("127.0.0.1", 0)


@dataclass(frozen=True)
class ResponseStart:
    status: int
    headers: Headers


async def call(app, request: HttpRequest) -> AsyncIterator[ResponseStart | bytes]:
    """The response's start, then its body pieces. Closing the iterator early is the client going away: the app's
    receive() answers http.disconnect, as a server's would, and the app gets a few seconds to finish."""
    sent: asyncio.Queue[dict | None] = asyncio.Queue()
    finished = asyncio.Event()
    incoming = [{"type": "http.request", "body": request.body, "more_body": False}]

    async def receive() -> dict:
        if incoming:
            return incoming.pop()
        await finished.wait()  # a streaming response polls for the client's disconnect here
        return {"type": "http.disconnect"}

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": request.method,
             "scheme": "http", "path": request.path, "raw_path": request.path.encode(), "root_path": "",
             "query_string": request.query, "headers": request.headers, "client": request.client,
             "server": ("127.0.0.1", 0), "state": {}}
    task = asyncio.ensure_future(app(scope, receive, sent.put))
    task.add_done_callback(lambda _: sent.put_nowait(None))
    try:
        while (message := await sent.get()) is not None:
            if message["type"] == "http.response.start":
                yield ResponseStart(message["status"], list(message.get("headers", [])))
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    return
        task.result()  # the app returned (or raised) before finishing its response
        raise RuntimeError("the app ended without a complete response")
    finally:
        finished.set()
        # An app may raise after sending its 500 (Starlette re-raises for the server to log): logged, not lost.
        await asyncio.wait({task}, timeout=5.0)
        if task.done() and not task.cancelled() and task.exception() is not None:
            log.error("the app raised while answering %s %s", request.method, request.path, exc_info=task.exception())
        elif not task.done():
            task.cancel()
