"""Pydantic models of the OpenAI request bodies this server takes (responses are built in render.py). Requests validate
strictly; unknown fields are ignored (clients send many optional ones); unsupported ones changing the result fail in
prepare.py."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(_Request):
    include_usage: bool = False


class ContentPart(_Request):
    type: str
    text: str | None = None


class FunctionCall(_Request):
    name: str = Field(min_length=1)
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Request):
    id: str = Field(min_length=1)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None  # tool turns: the call they answer


class FunctionDef(_Request):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class SamplingRequest(_Request):
    model: str = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)  # omitted → 1.0, as OpenAI; 0 → greedy
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int | None = Field(None, ge=1)
    user: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None  # {"token id": bias in [-100, 100]}; checked in penalties.py
    # KVBoost extensions (OpenAI clients pass them through extra_body)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)  # vLLM's / llama.cpp's
    repetition_penalty: float | None = Field(None, gt=0.0)  # transformers' / vLLM's (1 = off)
    cache_salt: str | None = None  # tenant isolation: K/V is shared only between equal salts
    # generate()'s own per-request options, checked by the engine (prepare.py): absent = the server's setting
    mode: str | None = None  # chunk_kv_reuse | prefix_cache | baseline
    content_reuse: bool | None = None
    speculative: str | None = None  # prompt_lookup | draft | off (null: off)
    num_speculative_tokens: int | None = None
    prompt_lookup_max_ngram: int | None = None
    prompt_lookup_min_ngram: int | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    response_format: dict[str, Any] | None = None  # checked by decoding.grammar.parse_output_format
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    prediction: dict[str, Any] | None = None  # Predicted Outputs: checked in prepare.py


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=5)  # the legacy API's top-k


class ResponsesRequest(_Request):
    """POST /v1/responses (server/responses.py turns it into a chat completion request)."""

    model: str = Field(min_length=1)
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = None
    stream: bool | None = False
    store: bool | None = True
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    metadata: dict[str, str] | None = None
    user: str | None = None
    # accepted where they change nothing here, refused otherwise (responses.to_chat)
    background: bool | None = None
    reasoning: dict[str, Any] | None = None
    truncation: str | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None


class TokenizeRequest(_Request):
    """POST /tokenize (vLLM's): the token ids a prompt or chat messages become here."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
