"""Prompt + max_tokens against the model's context: 400 context_length_exceeded as OpenAI and vLLM answer,
never a reply silently cut short; an omitted max_tokens is never rejected."""
from __future__ import annotations

import httpx
import openai
import pytest

from kvboost.errors import ContextLengthError
from kvboost.server.errors import to_api_error

from ..prompts import words as words_text
from .conftest import TINY_NAME


@pytest.fixture(scope="module")
def limit(tiny_engine) -> int:
    return tiny_engine.max_context


def _fill(count, limit: int, room: int) -> tuple[str, int]:
    """Text whose prompt (as `count` tokenizes it) leaves between 1 and `room` positions of the context free."""
    words = words_text(limit + 50, seed=5).split()
    lo, hi = 1, len(words)  # the most words that still leave at least one position
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count(" ".join(words[:mid])) <= limit - 1:
            lo = mid
        else:
            hi = mid - 1
    text = " ".join(words[:lo])
    n = count(text)
    assert 1 <= limit - n <= room, (limit, n)
    return text, n


def _chat(tiny_engine, room: int) -> tuple[list[dict], int]:
    """Messages leaving 1..room positions of the context free, and their exact token count."""
    text, n = _fill(lambda t: len(tiny_engine.encode(messages=[{"role": "user", "content": t}])),
                    tiny_engine.max_context, room)
    return [{"role": "user", "content": text}], n


def _prompt(tiny_engine, room: int) -> tuple[str, int]:
    return _fill(lambda t: len(tiny_engine.encode(t)), tiny_engine.max_context, room)


def _error(response: httpx.Response) -> dict:
    assert response.status_code == 400, response.text
    return response.json()["error"]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_max_tokens_past_the_context_is_400(server, tiny_engine, limit, stream):
    messages, n = _chat(tiny_engine, room=8)
    over = limit - n + 1
    with server.http() as http:
        error = _error(http.post("/v1/chat/completions", json={
            "model": TINY_NAME, "messages": messages, "max_tokens": over, "stream": stream}))
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
    assert error["type"] == "invalid_request_error"
    for number in (limit, n, over, n + over):  # both sides of the sum, the sum and the limit
        assert str(number) in error["message"], error["message"]


def test_chat_max_completion_tokens_is_checked_too(client, tiny_engine, limit):
    messages, n = _chat(tiny_engine, room=8)
    with pytest.raises(openai.BadRequestError) as info:  # the SDK raises it: a 400, not a cut reply
        client.chat.completions.create(model=TINY_NAME, messages=messages, max_completion_tokens=limit - n + 1)
    assert info.value.code == "context_length_exceeded"


def test_chat_max_tokens_that_exactly_fits_is_served(client, tiny_engine, limit):
    messages, n = _chat(tiny_engine, room=8)
    r = client.chat.completions.create(model=TINY_NAME, messages=messages, max_tokens=limit - n, temperature=0)
    assert r.usage.prompt_tokens == n and r.usage.completion_tokens <= limit - n


def test_chat_without_max_tokens_uses_the_rest_of_the_context(client, tiny_engine, limit):
    messages, n = _chat(tiny_engine, room=8)
    r = client.chat.completions.create(model=TINY_NAME, messages=messages, temperature=0)
    assert r.usage.prompt_tokens == n and 1 <= r.usage.completion_tokens <= limit - n


@pytest.mark.parametrize("stream", [False, True])
def test_completion_max_tokens_past_the_context_is_400(server, tiny_engine, limit, stream):
    prompt, n = _prompt(tiny_engine, room=10)
    with server.http() as http:
        error = _error(http.post("/v1/completions", json={
            "model": TINY_NAME, "prompt": prompt, "max_tokens": limit - n + 5, "stream": stream}))
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
    assert str(limit) in error["message"] and str(n) in error["message"]


def test_completion_default_budget_shrinks_to_what_is_left(client, tiny_engine, limit):
    prompt, n = _prompt(tiny_engine, room=10)
    assert limit - n < 16  # OpenAI's default of 16 tokens would not fit: it is lowered, not rejected
    r = client.completions.create(model=TINY_NAME, prompt=prompt, temperature=0)
    assert r.usage.prompt_tokens == n and r.usage.completion_tokens <= limit - n


def test_engine_context_error_maps_to_the_same_400():
    # The engine refuses prompt + max_new_tokens over the context itself; should that reach the server
    # (the check above runs first), the client still gets OpenAI's error, naming the request field.
    error = to_api_error(ContextLengthError("prompt + max_new_tokens exceed the context", "max_new_tokens"))
    assert (error.status, error.code, error.param) == (400, "context_length_exceeded", "max_tokens")
    body = error.body()["error"]
    assert body["type"] == "invalid_request_error" and body["code"] == "context_length_exceeded"
