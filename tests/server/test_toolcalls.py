"""Tool calls read out of generated text: streamed in pieces or whole, the same calls and content."""
from __future__ import annotations

import json

import pytest

from kvboost.server.toolcalls import ToolCallParser, parse_reply


def _stream(text: str, parse: str, step: int):
    parser = ToolCallParser(parse)
    events = []
    for i in range(0, len(text), step):
        events += parser.feed(text[i:i + step])
    events += parser.finish()
    content = "".join(e[1] for e in events if e[0] == "content")
    calls: list[list[str]] = []
    for e in events:
        if e[0] == "call":
            assert e[1] == len(calls)
            calls.append([e[2], ""])
        elif e[0] == "arguments":
            calls[e[1]][1] += e[2]
    return content, [tuple(c) for c in calls]


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_call_mode_streams_arguments_without_the_wrapper(step):
    text = '{"name": "get_weather", "arguments": {"city": "Paris", "days": {"n": 2}}}'
    content, calls = _stream(text, "call", step)
    assert content == "" and calls == [("get_weather", '{"city": "Paris", "days": {"n": 2}}')]
    whole = parse_reply(text, "call")
    assert [(c.name, c.arguments) for c in whole.calls] == calls
    assert json.loads(calls[0][1]) == {"city": "Paris", "days": {"n": 2}}


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_tagged_mode_splits_text_and_calls(step):
    text = ('Let me check. <tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>'
            '<tool_call>{"name": "b", "arguments": {}}</tool_call> done <tool')
    content, calls = _stream(text, "tagged", step)
    assert calls == [("a", '{"x": 1}'), ("b", "{}")]
    assert content == "Let me check.  done <tool"


def test_text_that_is_not_a_call_stays_content():
    assert parse_reply("a < b and <tool_call>oops", "tagged").content == "a < b and <tool_call>oops"
    cut = parse_reply('{"name": "f", "argu', "call")
    assert cut.calls == [] and cut.content == '{"name": "f", "argu'
