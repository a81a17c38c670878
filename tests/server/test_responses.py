"""/v1/responses through the openai SDK (responses.create / stream / parse) and LangChain: text and message input,
instructions, previous_response_id (the earlier turn's K/V reused), max_output_tokens, function tools, text.format,
stored responses, and errors in OpenAI's shape."""
from __future__ import annotations

import json

import openai
import pytest
from pydantic import BaseModel

from .conftest import TINY_NAME

pytest.importorskip("xgrammar")

BOUNDED = {"type": "object", "properties": {"unit": {"enum": ["C", "F"]}, "days": {"type": "integer", "minimum": 1,
                                                                                  "maximum": 7}},
           "required": ["unit", "days"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather forecast", "parameters": BOUNDED}


def test_create_answers_as_chat_completions_does(client):
    response = client.responses.create(model=TINY_NAME, instructions="Be brief.", input="Hello there",
                                       max_output_tokens=6, temperature=0)
    chat = client.chat.completions.create(model=TINY_NAME, max_tokens=6, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}])
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.output_tokens == 6 and response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    message = response.output[0]
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"


def test_a_follow_up_reuses_the_stored_conversation(client):
    first = client.responses.create(model=TINY_NAME, input=[{"role": "user", "content": "Tell me about cats."}],
                                    max_output_tokens=8, temperature=0)
    second = client.responses.create(model=TINY_NAME, previous_response_id=first.id, input="And dogs?",
                                     max_output_tokens=8, temperature=0)
    chat = client.chat.completions.create(model=TINY_NAME, max_tokens=8, temperature=0, messages=[
        {"role": "user", "content": "Tell me about cats."}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And dogs?"}])
    assert second.previous_response_id == first.id
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens // 2
    assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model=TINY_NAME, previous_response_id=first.id, input="again")
    assert info.value.param == "response_id"
    unstored = client.responses.create(model=TINY_NAME, input="hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_stream_events_build_the_same_response(client):
    kwargs = dict(model=TINY_NAME, input="Write a line about the sea.", max_output_tokens=12, temperature=0)
    whole = client.responses.create(**kwargs)
    deltas = []
    with client.responses.stream(**kwargs) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
    raw = list(client.responses.create(**kwargs, stream=True))
    assert [e.sequence_number for e in raw] == list(range(len(raw)))
    kinds = [e.type for e in raw]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert "".join(deltas) == whole.output_text == raw[-1].response.output_text
    assert raw[-1].response.usage.output_tokens == 12


def test_parse_follows_the_schema(client):
    class Forecast(BaseModel):
        unit: str
        days: int

    parsed = client.responses.parse(model=TINY_NAME, input="Weather in Paris?", text_format=Forecast,
                                    max_output_tokens=60, temperature=0)
    assert isinstance(parsed.output_parsed, Forecast)
    fmt = {"format": {"type": "json_schema", "name": "forecast", "schema": BOUNDED, "strict": True}}
    response = client.responses.create(model=TINY_NAME, input="Weather?", text=fmt, max_output_tokens=60,
                                       temperature=0)
    assert json.loads(response.output_text)["unit"] in ("C", "F")


def test_function_calls_and_their_outputs(client):
    called = client.responses.create(model=TINY_NAME, input="Weather in Paris?", tools=[WEATHER],
                                     tool_choice="required", max_output_tokens=60, temperature=0)
    calls = [item for item in called.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    assert json.loads(calls[0].arguments)["unit"] in ("C", "F")
    answered = client.responses.create(model=TINY_NAME, previous_response_id=called.id, tools=[WEATHER],
                                       input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                               "output": "Sunny, 21 C"}], max_output_tokens=5, temperature=0)
    assert answered.output and answered.usage.input_tokens_details.cached_tokens > 0
    streamed = list(client.responses.create(model=TINY_NAME, input="Weather in Paris?", tools=[WEATHER],
                                            tool_choice="required", max_output_tokens=60, temperature=0,
                                            stream=True))
    kinds = [e.type for e in streamed]
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    done = next(e for e in streamed if e.type == "response.function_call_arguments.done")
    assert done.name == "get_weather" and done.arguments == calls[0].arguments


@pytest.mark.parametrize("kwargs, param", [
    ({"input": [{"type": "input_image", "image_url": "http://x"}]}, "input.0"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools.0"),
    ({"input": "hi", "truncation": "auto"}, "truncation"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
])
def test_what_is_not_supported_is_refused_by_name(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=TINY_NAME, **kwargs)
    assert info.value.param == param


def test_langchain_through_the_responses_api(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(model=TINY_NAME, base_url=server.url + "/v1", api_key="unused",
                                      use_responses_api=True, max_tokens=5, temperature=0)
    reply = llm.invoke("Hello there")
    assert reply.text and reply.usage_metadata["output_tokens"] == 5
    chunks = list(llm.stream("Hello there"))
    assert "".join(c.text for c in chunks) == reply.text
