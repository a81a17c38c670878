"""The clients users bring, against a live server with the embedded model: each must get back a parsed object
that is valid for its schema (not just a 200). Skipped where a client library is not installed."""
from __future__ import annotations

import json

import pytest
from pydantic import BaseModel, Field

from kvboost import KVBoost

from .conftest import live_server

pytestmark = pytest.mark.slow
pytest.importorskip("xgrammar")
MODEL = "smol"
TEXT = "Alice Martin is a 34 year old engineer who lives in Lyon."


class Person(BaseModel):
    name: str = Field(description="the person's full name")
    age: int = Field(ge=0, le=130)
    city: str


def _check(person: Person) -> None:
    assert isinstance(person, Person)
    Person.model_validate(person.model_dump())  # bounds and types hold


@pytest.fixture(scope="module")
def server(smol):
    model, tokenizer = smol
    with live_server(KVBoost(model, tokenizer), served_model_name=MODEL) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def _messages():
    # Instructor's JSON mode constrains only to "a JSON object" and puts the schema in the system prompt; the 135M
    # model then copies the schema unless the question names the fields, as this one does.
    return [{"role": "user", "content": f"{TEXT} Reply with her name, age and city as a JSON object."}]


def test_openai_sdk_parse_with_a_pydantic_model(client):
    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    r = parse(model=MODEL, messages=_messages(), response_format=Person, temperature=0, max_tokens=80)
    person = r.choices[0].message.parsed
    _check(person)
    assert person.age == 34


def test_langchain_structured_output_and_tool_round_trip(server):
    lc = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    llm = lc.ChatOpenAI(model=MODEL, base_url=server.url + "/v1", api_key="x", temperature=0, max_tokens=80,
                        max_retries=0)
    prompt = f"Extract the person: {TEXT}"
    for method in ("json_schema", "function_calling"):
        _check(llm.with_structured_output(Person, method=method).invoke(prompt))

    @tool
    def get_weather(city: str, unit: str = "C") -> str:
        """The current weather in a city."""
        return f"sunny, 21 {unit} in {city}"

    question = HumanMessage("What is the weather in Lyon?")
    ai = llm.bind_tools([get_weather], tool_choice="get_weather").invoke([question])
    (call,) = ai.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"].get("city"), str)
    result = get_weather.invoke(call["args"])
    answer = llm.bind_tools([get_weather]).invoke([question, ai, ToolMessage(result, tool_call_id=call["id"])])
    assert isinstance(answer.content, str) and (answer.content or answer.tool_calls)


@pytest.mark.parametrize("mode", ["JSON", "TOOLS", "JSON_SCHEMA"])
def test_instructor_modes(client, mode):
    instructor = pytest.importorskip("instructor")
    patched = instructor.from_openai(client, mode=getattr(instructor.Mode, mode))
    person = patched.chat.completions.create(model=MODEL, response_model=Person, messages=_messages(),
                                             temperature=0, max_tokens=120, max_retries=1)
    _check(person)


def test_llamaindex_structured_predict(server):
    openai_like = pytest.importorskip("llama_index.llms.openai_like")
    from llama_index.core.prompts import PromptTemplate

    llm = openai_like.OpenAILike(model=MODEL, api_base=server.url + "/v1", api_key="x", is_chat_model=True,
                                 is_function_calling_model=True, context_window=8192, max_tokens=80,
                                 temperature=0, max_retries=0)
    person = llm.structured_predict(Person, PromptTemplate("Extract the person: {text}"), text=TEXT)
    _check(person)


def test_auto_tool_choice_reply_is_text_or_a_valid_call(client):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                               "parameters": {"type": "object", "properties": {
                                                   "city": {"type": "string"}}, "required": ["city"]}}}]
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather in Lyon?"}],
                                       tools=tools, temperature=0, max_tokens=60)
    message = r.choices[0].message
    for call in message.tool_calls or []:
        assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str)
    assert message.tool_calls or message.content
