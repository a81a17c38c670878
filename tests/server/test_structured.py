"""response_format, tools / tool_choice, tool messages, logprobs and n through a live server (tiny random model:
whatever it writes, the grammar decides the shape)."""
from __future__ import annotations

import json

import openai
import pytest

from .conftest import TINY_NAME

pytest.importorskip("xgrammar")

CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]
BOUNDED = {"type": "object", "properties": {"unit": {"enum": ["C", "F"]}, "days": {"type": "integer", "minimum": 1,
                                                                                  "maximum": 7}},
           "required": ["unit", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                           "parameters": BOUNDED}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"]}}}]


def _valid(args: dict, schema: dict) -> bool:
    import jsonschema

    try:
        jsonschema.validate(args, schema)
    except jsonschema.ValidationError:
        return False
    return True


def test_json_schema_and_json_object(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": BOUNDED, "strict": True}}
    r = client.chat.completions.create(model=TINY_NAME, messages=CHAT, max_tokens=300, temperature=0,
                                       response_format=fmt)
    assert _valid(json.loads(r.choices[0].message.content), BOUNDED)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=TINY_NAME, messages=CHAT, max_tokens=300, temperature=0, response_format=fmt, stream=True) if c.choices)
    assert streamed == r.choices[0].message.content
    obj = client.chat.completions.create(model=TINY_NAME, messages=CHAT, max_tokens=30, temperature=0,
                                         response_format={"type": "json_object"})
    assert obj.choices[0].message.content.startswith("{")


def test_json_cut_by_max_tokens_is_closed_and_reported_as_length(client):
    """An unbounded string the random model never ends: max_tokens closes the object, finish_reason says so."""
    schema = {"type": "object", "properties": {"note": {"type": "string"}, "n": {"type": "integer"}},
              "required": ["note", "n"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "note", "schema": schema, "strict": True}}
    for stream in (False, True):
        kw = dict(model=TINY_NAME, messages=CHAT, max_tokens=40, temperature=0, response_format=fmt)
        if stream:
            chunks = [c for c in client.chat.completions.create(**kw, stream=True) if c.choices]
            text = "".join(c.choices[0].delta.content or "" for c in chunks)
            reason = chunks[-1].choices[0].finish_reason
        else:
            r = client.chat.completions.create(**kw)
            text, reason = r.choices[0].message.content, r.choices[0].finish_reason
        assert _valid(json.loads(text), schema) and reason == "length", (text, reason)


def test_named_and_required_tool_choice(client):
    r = client.chat.completions.create(model=TINY_NAME, messages=CHAT, max_tokens=300, temperature=0, tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_") and call.type == "function"
    assert _valid(json.loads(call.function.arguments), BOUNDED)
    req = client.chat.completions.create(model=TINY_NAME, messages=CHAT, max_tokens=300, temperature=0.9, seed=4,
                                         tools=TOOLS, tool_choice="required")
    (call,) = req.choices[0].message.tool_calls
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[call.function.name]
    assert _valid(json.loads(call.function.arguments), schema)


def test_tool_calls_stream_as_openai_streams_them(client):
    kwargs = dict(model=TINY_NAME, messages=CHAT, max_tokens=300, temperature=0, tools=TOOLS,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    full = client.chat.completions.create(**kwargs).choices[0].message.tool_calls[0]
    chunks = [c for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    head, rest = deltas[0], deltas[1:]
    assert head.index == 0 and head.id.startswith("call_") and head.function.name == "get_weather"
    assert head.function.arguments == "" and rest and all(d.id is None and d.function.name is None for d in rest)
    assert "".join(d.function.arguments for d in rest) == full.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_tool_round_trip_renders_the_history(client, server):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                             "arguments": '{"unit": "C", "days": 2}'}}
    history = CHAT + [{"role": "assistant", "content": None, "tool_calls": [call]},
                      {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    r = client.chat.completions.create(model=TINY_NAME, messages=history, max_tokens=8, temperature=0, tools=TOOLS,
                                       tool_choice="none")
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")
    # The generic format put the call and its result into the prompt.
    with server.http() as http:
        body = http.post("/v1/chat/completions", json=dict(model=TINY_NAME, messages=history, max_tokens=1,
                                                           tools=TOOLS, tool_choice="none")).json()
    assert body["usage"]["prompt_tokens"] > client.chat.completions.create(
        model=TINY_NAME, messages=CHAT, max_tokens=1).usage.prompt_tokens + 40


@pytest.mark.parametrize("body, param", [
    ({"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}},
     "response_format.json_schema.schema"),
    ({"messages": CHAT, "response_format": {"type": "yaml"}}, "response_format.type"),
    ({"messages": CHAT, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"messages": CHAT, "tool_choice": "required"}, "tool_choice"),
    ({"messages": CHAT, "tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format"),
    ({"messages": CHAT + [{"role": "tool", "tool_call_id": "call_9", "content": "x"}], "tools": TOOLS},
     "messages.1.tool_call_id"),
    ({"messages": CHAT + [{"role": "tool", "content": "x"}]}, "messages.1.tool_call_id"),
    ({"messages": CHAT + [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "get_weather", "arguments": "{not json"}}]}]}, "messages.1.tool_calls.0.function.arguments"),
    ({"messages": CHAT, "tools": [{"type": "function", "function": {"name": "bad name!"}}]}, None),
])
def test_bad_structured_requests_are_400(server, body, param):
    with server.http() as http:
        r = http.post("/v1/chat/completions", json={"model": TINY_NAME, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    if param is not None:
        assert error["param"] == param


def test_logprobs_on_chat_and_completions(client, tiny_engine):
    r = client.chat.completions.create(model=TINY_NAME, messages=CHAT, max_tokens=5, temperature=0, logprobs=True,
                                       top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens and all(len(t.top_logprobs) == 2 for t in content)
    assert all(t.logprob <= 0 and t.top_logprobs[0].logprob >= t.logprob for t in content)  # greedy: the best one
    assert "".join(t.token for t in content) == r.choices[0].message.content
    stream = [c for c in client.chat.completions.create(model=TINY_NAME, messages=CHAT, max_tokens=5, temperature=0,
                                                        logprobs=True, stream=True) if c.choices]
    last = stream[-1].choices[0]
    assert [t.logprob for t in last.logprobs.content] == pytest.approx([t.logprob for t in content], abs=1e-4)
    c = client.completions.create(model=TINY_NAME, prompt="The weather", max_tokens=4, temperature=0, logprobs=3)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 4 and all(len(t) <= 3 for t in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == c.choices[0].text


def test_n_choices(client):
    r = client.chat.completions.create(model=TINY_NAME, messages=CHAT, max_tokens=6, temperature=1.0, seed=3, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.message.content for c in r.choices]
    assert len(set(texts)) > 1  # seed + i per choice
    single = client.chat.completions.create(model=TINY_NAME, messages=CHAT, max_tokens=6, temperature=1.0, seed=3)
    assert texts[0] == single.choices[0].message.content
    assert r.usage.prompt_tokens == single.usage.prompt_tokens
    assert r.usage.completion_tokens >= 3  # each choice's tokens count
    stream = client.chat.completions.create(model=TINY_NAME, messages=CHAT, max_tokens=6, temperature=1.0, seed=3,
                                            n=2, stream=True, stream_options={"include_usage": True})
    pieces = {0: "", 1: ""}
    finished = set()
    for chunk in stream:
        for ch in chunk.choices:
            pieces[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finished.add(ch.index)
    assert finished == {0, 1} and [pieces[0], pieces[1]] == texts[:2]
    comp = client.completions.create(model=TINY_NAME, prompt="Once", max_tokens=4, temperature=0, n=2)
    assert len(comp.choices) == 2 and comp.choices[0].text == comp.choices[1].text  # greedy: the same
    fmt = {"type": "json_schema", "json_schema": {"name": "f", "schema": BOUNDED}}
    both = client.chat.completions.create(model=TINY_NAME, messages=CHAT, max_tokens=300, temperature=1.0, n=2,
                                          response_format=fmt)
    assert all(_valid(json.loads(c.message.content), BOUNDED) for c in both.choices)


def test_max_completion_tokens_still_counts(client):
    r = client.chat.completions.create(model=TINY_NAME, messages=CHAT, max_completion_tokens=3, temperature=0)
    assert r.usage.completion_tokens <= 3


def test_missing_tool_arguments_schema_means_any_object(client):
    tools = [{"type": "function", "function": {"name": "ping"}}]
    r = client.chat.completions.create(model=TINY_NAME, messages=CHAT, max_tokens=30, temperature=0, tools=tools,
                                       tool_choice="required")
    call = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls"
    assert call[0].function.name == "ping" and isinstance(json.loads(call[0].function.arguments), dict)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=TINY_NAME, messages=CHAT, max_tokens=3,
                                       tools=[{"type": "function", "function": {"name": "x", "parameters": {
                                           "type": "array"}}}])


def test_auto_grammar_allows_text_or_calls_with_valid_arguments(tiny_engine):
    from kvboost.server.schema import Tool
    from kvboost.server.tools import setup_tools

    setup = setup_tools([Tool.model_validate(t) for t in TOOLS], "auto")
    assert setup.parse == "tagged"
    tok = tiny_engine.tokenizer

    def walk(text: str) -> bool:
        c = tiny_engine.grammars.prepare(setup.output_format).constraint()
        for t in tok.encode(text, add_special_tokens=False):
            if not c.accepts(t):
                return False
            c.advance(t)
        return c.accepts(tok.eos_token_id)

    assert walk("It is sunny.")
    assert walk('Checking. <tool_call>{"name": "get_weather", "arguments": {"unit": "C", "days": 3}}</tool_call>')
    assert not walk('<tool_call>{"name": "get_weather", "arguments": {"unit": "K", "days": 3}}</tool_call>')
    assert not walk('<tool_call>{"name": "get_weather", "arguments": {"unit": "C", "days": 3}}')  # unclosed
    two_calls = ('<tool_call>{"name": "get_weather", "arguments": {"unit": "C", "days": 3}}</tool_call>'
                 '<tool_call>{"name": "get_weather", "arguments": {"unit": "F", "days": 1}}</tool_call>')
    assert walk(two_calls)
    # parallel_tool_calls false: the reply ends with its first call (then only EOS is allowed).
    setup = setup_tools([Tool.model_validate(t) for t in TOOLS], "auto", parallel_tool_calls=False)
    assert walk('Checking. <tool_call>{"name": "get_weather", "arguments": {"unit": "C", "days": 3}}</tool_call>')
    assert walk("It is sunny.")
    assert not walk(two_calls)


def test_n_choices_run_as_rows_of_one_batch(server, client, tiny_engine):
    from ..prompts import words

    messages = [{"role": "system", "content": words(120, 5)}, {"role": "user", "content": "hi"}]
    before = server.scheduler.stats.max_rows_in_a_step
    server.scheduler.stats.max_rows_in_a_step = 0
    try:
        r = client.chat.completions.create(model=TINY_NAME, messages=messages, max_tokens=6, temperature=1.0,
                                           seed=1, n=4)
        assert len(r.choices) == 4 and server.scheduler.stats.max_rows_in_a_step == 4
        # A new prompt, yet the rows reused its K/V: the batch computed the shared prompt once for all of them.
        assert r.usage.prompt_tokens_details.cached_tokens >= r.usage.prompt_tokens - 16
    finally:
        server.scheduler.stats.max_rows_in_a_step = max(before, server.scheduler.stats.max_rows_in_a_step)


def test_formats_on_the_single_request_worker_and_completions(tiny_engine, tiny_model_dir):
    from .conftest import live_server

    fmt = {"type": "json_schema", "json_schema": {"name": "f", "schema": BOUNDED}}
    with live_server(tiny_engine, model=str(tiny_model_dir), max_batch_size=1) as srv:
        sdk = srv.client()
        r = sdk.chat.completions.create(model=TINY_NAME, messages=CHAT, max_tokens=300, temperature=0,
                                        response_format=fmt, n=2)
        assert all(_valid(json.loads(c.message.content), BOUNDED) for c in r.choices)
        call = sdk.chat.completions.create(model=TINY_NAME, messages=CHAT, max_tokens=300, temperature=0,
                                           tools=TOOLS, tool_choice="required").choices[0].message.tool_calls[0]
        assert call.function.name in ("get_weather", "get_time")
        c = sdk.completions.create(model=TINY_NAME, prompt="Forecast:", max_tokens=300, temperature=0,
                                   extra_body={"response_format": fmt})
        assert _valid(json.loads(c.choices[0].text), BOUNDED)
        with pytest.raises(openai.BadRequestError):
            sdk.completions.create(model=TINY_NAME, prompt="x", max_tokens=3,
                                   extra_body={"response_format": {"type": "json_schema"}})
