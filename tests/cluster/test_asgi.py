"""cluster/asgi.py: one request through an ASGI app in process, its response as the app sends it: status and
headers first, then each body piece (a stream piece by piece), the app told the client left when the caller stops
reading, and an app that fails is an exception, never a hang."""
from __future__ import annotations

import asyncio

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from kvboost.cluster.asgi import HttpRequest, ResponseStart, call

LEFT: list[str] = []


async def echo(request: Request) -> JSONResponse:
    return JSONResponse({"body": (await request.body()).decode(), "query": request.url.query,
                         "auth": request.headers.get("authorization"), "client": request.client.host}, 201)


async def counting(request: Request) -> StreamingResponse:
    async def pieces():
        try:
            for i in range(1000):
                yield f"data: {i}\n\n"
                await asyncio.sleep(0.005)
        finally:
            LEFT.append("stopped")

    return StreamingResponse(pieces(), media_type="text/event-stream")


async def broken(request: Request):
    raise RuntimeError("boom")


APP = Starlette(routes=[Route("/echo", echo, methods=["POST"]), Route("/count", counting),
                        Route("/broken", broken)])


async def _collect(request: HttpRequest, limit: int | None = None) -> list:
    out = []
    stream = call(APP, request)
    async for piece in stream:
        out.append(piece)
        if limit is not None and len(out) >= limit:
            await stream.aclose()
            break
    return out


def test_a_request_gets_its_status_headers_and_body():
    out = asyncio.run(_collect(HttpRequest("POST", "/echo", b"x=1", [(b"authorization", b"Bearer k")], b"hello",
                                           ("10.0.0.7", 1234))))
    start, body = out[0], b"".join(out[1:])
    assert isinstance(start, ResponseStart) and start.status == 201
    assert (b"content-type", b"application/json") in start.headers
    assert body == b'{"body":"hello","query":"x=1","auth":"Bearer k","client":"10.0.0.7"}'


def test_a_stream_arrives_piece_by_piece_and_stops_when_the_reader_does():
    LEFT.clear()
    out = asyncio.run(_collect(HttpRequest("GET", "/count"), limit=4))
    assert out[0].status == 200
    assert out[1:] == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n"]
    assert LEFT == ["stopped"]  # the app's generator was closed, not left running


def test_an_app_that_fails_answers_500_and_the_error_is_logged(caplog):
    out = asyncio.run(asyncio.wait_for(_collect(HttpRequest("GET", "/broken")), 10))
    assert out[0].status == 500 and b"".join(out[1:]) == b"Internal Server Error"
    assert any("the app raised while answering GET /broken" in r.message for r in caplog.records)


def test_an_app_that_ends_without_a_response_is_an_error():
    async def silent(scope, receive, send):
        await receive()

    async def run():
        return [piece async for piece in call(silent, HttpRequest("GET", "/"))]

    with pytest.raises(RuntimeError, match="without a complete response"):
        asyncio.run(asyncio.wait_for(run(), 10))
