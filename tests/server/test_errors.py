"""Errors reach clients as OpenAI error bodies (and as the openai SDK's exception classes); the server survives."""
from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from ..prompts import text_with_tokens, words
from .conftest import TINY_NAME

CHAT = [{"role": "user", "content": "hello"}]


def _assert_error_body(response: httpx.Response, status: int, param: str | None = "skip") -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    if param != "skip":
        assert body["error"]["param"] == param
    return body["error"]


def test_unknown_model_is_404_model_not_found(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=CHAT, max_tokens=2)
    assert info.value.code == "model_not_found" and info.value.param == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


@pytest.mark.parametrize("body, param", [
    ({"model": TINY_NAME, "messages": CHAT, "temperature": "hot"}, "temperature"),
    ({"model": TINY_NAME, "messages": CHAT, "max_tokens": "5"}, "max_tokens"),
    ({"model": TINY_NAME, "messages": CHAT, "max_tokens": 0}, "max_tokens"),
    ({"model": TINY_NAME, "messages": CHAT, "temperature": 3}, "temperature"),
    ({"model": TINY_NAME, "messages": CHAT, "top_p": 0}, "top_p"),
    ({"model": TINY_NAME, "messages": CHAT, "stream": "yes"}, "stream"),
    ({"model": TINY_NAME}, "messages"),
    ({"messages": CHAT}, "model"),
    ({"model": TINY_NAME, "messages": []}, "messages"),
    ({"model": TINY_NAME, "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ({"model": TINY_NAME, "messages": [{"role": "user", "content": 5}]}, None),
    ({"model": TINY_NAME, "messages": CHAT, "n": 17}, "n"),
    ({"model": TINY_NAME, "messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
    ({"model": TINY_NAME, "messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"model": TINY_NAME, "messages": CHAT, "stop": [""]}, "stop"),
    ({"model": TINY_NAME, "messages": CHAT, "frequency_penalty": 2.5}, "frequency_penalty"),
    ({"model": TINY_NAME, "messages": CHAT, "presence_penalty": -3}, "presence_penalty"),
    ({"model": TINY_NAME, "messages": CHAT, "repetition_penalty": 0}, "repetition_penalty"),
    ({"model": TINY_NAME, "messages": CHAT, "logit_bias": {"12": 101}}, "logit_bias"),
    ({"model": TINY_NAME, "messages": CHAT, "logit_bias": {"hello": 1}}, "logit_bias"),
    ({"model": TINY_NAME, "messages": CHAT, "logit_bias": {"999999999": 1}}, "logit_bias"),  # not in the vocab
    ({"model": TINY_NAME, "messages": CHAT, "logit_bias": {"12": "x"}}, "logit_bias.12"),
    ({"model": TINY_NAME, "messages": CHAT, "prediction": {"type": "image", "content": "x"}}, "prediction"),
    # OpenAI fields that would change the reply and are not implemented: refused, never silently ignored.
    ({"model": TINY_NAME, "messages": CHAT, "modalities": ["text", "audio"]}, "modalities"),
    ({"model": TINY_NAME, "messages": CHAT, "audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"model": TINY_NAME, "messages": CHAT, "web_search_options": {}}, "web_search_options"),
    ({"model": TINY_NAME, "messages": CHAT, "reasoning_effort": "high"}, "reasoning_effort"),
])
def test_invalid_chat_bodies_are_400(server, body, param):
    with server.http() as http:
        error = _assert_error_body(http.post("/v1/chat/completions", json=body), 400)
    if param is not None:
        assert error["param"] == param


@pytest.mark.parametrize("raw", [b"{bad json", b"[1, 2]", b"", b"null"])
def test_malformed_json_is_400_whatever_the_content_type(server, raw):
    with server.http() as http:
        for headers in ({"content-type": "application/json"}, {"content-type": "application/x-www-form-urlencoded"}):
            _assert_error_body(http.post("/v1/chat/completions", content=raw, headers=headers), 400)


def test_curl_style_form_content_type_is_still_parsed(server):
    with server.http() as http:
        body = b'{"model": "%s", "prompt": "hi", "max_tokens": 2}' % TINY_NAME.encode()
        r = http.post("/v1/completions", content=body,
                      headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("body, param", [
    ({"model": TINY_NAME, "prompt": ""}, "prompt"),
    ({"model": TINY_NAME, "prompt": ["a", "b"]}, "prompt"),
    ({"model": TINY_NAME, "prompt": [[1, 2], [3, 4]]}, "prompt"),
    ({"model": TINY_NAME, "prompt": [1, 2, 10**9]}, "prompt"),  # outside the vocabulary
    ({"model": TINY_NAME, "prompt": [1, -2]}, "prompt"),
    ({"model": TINY_NAME, "prompt": [[]]}, "prompt"),
    ({"model": TINY_NAME, "prompt": "hi", "echo": True}, "echo"),
    ({"model": TINY_NAME, "prompt": "hi", "best_of": 3}, "best_of"),
    ({"model": TINY_NAME, "prompt": "hi", "frequency_penalty": -2.01}, "frequency_penalty"),
    ({"model": TINY_NAME, "prompt": "hi", "logit_bias": {"-1": 5}}, "logit_bias"),
])
def test_invalid_completion_bodies_are_400(server, body, param):
    with server.http() as http:
        _assert_error_body(http.post("/v1/completions", json=body), 400, param)


def test_sdk_raises_bad_request_for_wrong_types_and_n(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=TINY_NAME, messages=CHAT, temperature="hot")  # type: ignore[arg-type]
    assert info.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=TINY_NAME, messages=CHAT, n=17)
    assert info.value.param == "n"


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_longer_than_the_context_is_400(client, tiny_engine, stream):
    long_text = text_with_tokens(tiny_engine.tokenizer, tiny_engine.max_context + 50, seed=1)
    with pytest.raises(openai.BadRequestError) as info:  # raised before any stream starts
        client.completions.create(model=TINY_NAME, prompt=long_text, max_tokens=2, stream=stream)
    assert info.value.code == "context_length_exceeded" and info.value.param == "prompt"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=TINY_NAME, messages=[{"role": "user", "content": long_text}],
                                       max_tokens=2, stream=stream)
    assert info.value.code == "context_length_exceeded" and info.value.param == "messages"


def test_unknown_route_and_method_use_the_error_body(server):
    with server.http() as http:
        _assert_error_body(http.get("/v1/nothing-here"), 404)
        _assert_error_body(http.get("/v1/chat/completions"), 405)


def test_engine_failure_is_500_and_the_server_stays_up(server, client, tiny_engine):
    def broken(*args, **kwargs):
        raise RuntimeError("simulated kernel failure")

    tiny_engine.model.forward = broken
    try:
        with pytest.raises(openai.InternalServerError) as info:
            client.chat.completions.create(model=TINY_NAME, messages=CHAT, max_tokens=3)
        assert "simulated kernel failure" in info.value.message
        stream = client.chat.completions.create(model=TINY_NAME, messages=CHAT, max_tokens=3, stream=True)
        with pytest.raises(openai.APIError, match="simulated kernel failure"):
            list(stream)
    finally:
        del tiny_engine.model.forward
    server.wait_idle()
    r = client.chat.completions.create(model=TINY_NAME, messages=CHAT, max_tokens=3, temperature=0)
    assert r.choices[0].message.content is not None
    with server.http() as http:
        assert http.get("/health").json()["status"] == "ok"


def test_stats_and_metrics_never_500(server, client, tiny_engine, monkeypatch):
    client.completions.create(model=TINY_NAME, prompt="warm up the counters", max_tokens=2)
    with server.http() as http:
        stats = http.get("/v1/stats")
        assert stats.status_code == 200 and "requests" in stats.json()["cache"]
        assert "completed" in stats.json()["scheduler"]

        def broken():
            raise RuntimeError("store unreachable")

        monkeypatch.setattr(tiny_engine, "cache_stats", broken)
        stats = http.get("/v1/stats")
        assert stats.status_code == 200 and "store unreachable" in stats.json()["cache"]["error"]
        metrics = http.get("/metrics")
        assert metrics.status_code == 200
    text = metrics.text
    for name in ("kvboost_requests_total", "kvboost_ttft_seconds_bucket", "kvboost_request_latency_seconds_bucket",
                 "kvboost_prompt_tokens_total", "kvboost_completion_tokens_total",
                 "kvboost_cached_prompt_tokens_total", "kvboost_cache_reuse_ratio", "kvboost_queue_depth"):
        assert name in text
    assert 'kvboost_requests_total{route="/v1/completions",status="200"}' in text


def test_api_key_required_when_configured(start_server, tiny_engine):
    with start_server(tiny_engine, api_key="sekret") as srv:
        with pytest.raises(openai.AuthenticationError):
            srv.client(api_key="wrong").chat.completions.create(model=TINY_NAME, messages=CHAT, max_tokens=2)
        with srv.http() as http:
            _assert_error_body(http.get("/v1/models"), 401)
            assert http.get("/health").status_code == 200  # probes and scrapes need no key
        r = srv.client(api_key="sekret").chat.completions.create(model=TINY_NAME, messages=CHAT, max_tokens=2)
        assert r.choices[0].message.content is not None


def _gate_model(engine) -> threading.Event:
    """Block every forward pass until the returned event is set (at most 20 s, so nothing hangs)."""
    gate = threading.Event()
    original = engine.model.forward

    def gated(*args, **kwargs):
        gate.wait(20)
        return original(*args, **kwargs)

    engine.model.forward = gated
    return gate


def _wait(condition, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def test_full_queue_is_429_with_retry_after(start_server, patchable_engine):
    engine = patchable_engine  # its forwards call model.forward on every device: the gate blocks them
    with start_server(engine, max_queue=1, max_batch_size=1) as srv:
        gate = _gate_model(engine)
        results: list[int] = []
        try:
            def send(prompt: str) -> None:
                with srv.http() as http:
                    results.append(http.post("/v1/completions", json={
                        "model": TINY_NAME, "prompt": prompt, "max_tokens": 2}).status_code)

            first = threading.Thread(target=send, args=("the first request",))
            first.start()
            _wait(lambda: srv.scheduler.active_count() == 1)  # running (blocked in forward)
            second = threading.Thread(target=send, args=("the second request",))
            second.start()
            _wait(lambda: srv.scheduler.queue_depth() == 1)  # waiting: the queue is full now
            with srv.http() as http:
                r = http.post("/v1/completions", json={"model": TINY_NAME, "prompt": "one too many", "max_tokens": 2})
            _assert_error_body(r, 429)
            assert int(r.headers["retry-after"]) >= 1
            with pytest.raises(openai.RateLimitError):
                srv.client().completions.create(model=TINY_NAME, prompt="again", max_tokens=2)
        finally:
            gate.set()
            del engine.model.forward
        first.join(30)
        second.join(30)
        assert results == [200, 200]


@pytest.mark.parametrize("batch, stream", [(16, True), (1, True), (16, False), (1, False)])
def test_client_disconnect_stops_generation(start_server, tiny_engine, batch, stream):
    with start_server(tiny_engine, max_batch_size=batch) as srv:
        original = tiny_engine.model.forward

        def slow(*args, **kwargs):  # ~5 s for the requested 900 tokens, unless cancelled
            time.sleep(0.005)
            return original(*args, **kwargs)

        tiny_engine.model.forward = slow
        body = {"model": TINY_NAME, "prompt": words(10, 9), "max_tokens": 900, "temperature": 1.0, "seed": 1}
        try:
            if stream:
                chunks = srv.client().completions.create(**body, stream=True)
                for i, _ in enumerate(chunks):
                    if i == 2:
                        break
                chunks.close()
            else:  # the client gives up waiting and closes the connection
                with pytest.raises(httpx.TimeoutException), srv.http() as http:
                    http.post("/v1/completions", json=body, timeout=0.5)
            _wait(lambda: srv.scheduler.stats.cancelled >= 1 and srv.scheduler.active_count() == 0, timeout=4.0)
        finally:
            del tiny_engine.model.forward
        assert srv.scheduler.stats.completed == 0
        r = srv.client().completions.create(model=TINY_NAME, prompt="still alive?", max_tokens=2)
        assert r.choices[0].text is not None


def test_a_body_too_deep_or_too_large_is_a_400_and_the_connection_stays_usable(server, monkeypatch):
    from kvboost.server import app as server_app

    chat = {"model": TINY_NAME, "messages": CHAT, "max_tokens": 2}
    with server.http() as http:  # one keep-alive connection for every request below
        deep = "[" * 5000 + "]" * 5000
        for body in (f'{{"model": "{TINY_NAME}", "messages": {deep}}}', "[" * 100 + "]" * 100):
            error = _assert_error_body(http.post("/v1/chat/completions", content=body), 400)
            assert error["type"] == "invalid_request_error" and "levels deep" in error["message"]
        nested = {"model": TINY_NAME, "messages": CHAT, "max_tokens": 2, "metadata": {"a": [[[[["fine"]]]]]}}
        assert http.post("/v1/chat/completions", json=nested).status_code != 500
        monkeypatch.setattr(server_app, "MAX_BODY_BYTES", 4096)
        error = _assert_error_body(http.post("/v1/chat/completions", json={**chat, "user": "x" * 5000}), 400)
        assert error["code"] == "request_too_large"
        assert http.post("/v1/chat/completions", json=chat).status_code == 200


def test_the_access_log_has_a_line_per_request_with_its_tokens(tiny_engine, start_server, caplog):
    import logging

    caplog.set_level(logging.INFO, logger="kvboost.access")
    with start_server(tiny_engine, access_log=True) as srv:
        srv.client().chat.completions.create(model=TINY_NAME, messages=CHAT, max_tokens=3, temperature=0)
        with srv.http() as http:
            http.get("/v1/models/nope")
    lines = [r.getMessage() for r in caplog.records if r.name == "kvboost.access"]
    chat_line = next(line for line in lines if line.startswith("POST /v1/chat/completions 200 "))
    assert " ms prompt=" in chat_line and chat_line.endswith("completion=3")
    assert int(chat_line.split("prompt=")[1].split()[0]) > 0
    assert any(line.startswith("GET /v1/models/nope 404 ") for line in lines)
