"""OpenAI response bodies and SSE chunks for chat and text completions, built from engine results."""
from __future__ import annotations

import json
import time
import uuid
from typing import Any

from ..results import GenerationResult
from .schema import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChunkDelta,
    Completion,
    CompletionChoice,
    PromptTokensDetails,
    Usage,
    dump,
)

DONE = "data: [DONE]\n\n"


def sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


def usage_of(result: GenerationResult) -> Usage:
    return Usage(prompt_tokens=result.prompt_tokens, completion_tokens=result.generated_tokens,
                 total_tokens=result.prompt_tokens + result.generated_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=result.cached_tokens))


class ChatRenderer:
    """chat.completion and chat.completion.chunk bodies for one request."""

    endpoint = "chat"

    def __init__(self, model: str, fingerprint: str | None = None):
        self.id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        self.model = model
        self.created = int(time.time())
        self.fingerprint = fingerprint

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> dict[str, Any]:
        return dump(ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices,
                                        usage=usage, system_fingerprint=self.fingerprint))

    def head(self) -> dict[str, Any] | None:
        return self._chunk([ChatChunkChoice(delta=ChunkDelta(role="assistant", content=""))])

    def delta(self, text: str) -> dict[str, Any]:
        return self._chunk([ChatChunkChoice(delta=ChunkDelta(content=text))])

    def final(self, result: GenerationResult) -> dict[str, Any]:
        return self._chunk([ChatChunkChoice(delta=ChunkDelta(), finish_reason=result.finish_reason)])

    def usage(self, result: GenerationResult) -> dict[str, Any]:
        return self._chunk([], usage_of(result))

    def full(self, result: GenerationResult) -> dict[str, Any]:
        choice = ChatChoice(message=AssistantMessage(content=result.output_text), finish_reason=result.finish_reason)
        return dump(ChatCompletion(id=self.id, created=self.created, model=self.model, choices=[choice],
                                   usage=usage_of(result), system_fingerprint=self.fingerprint))


class CompletionRenderer:
    """text_completion bodies (streamed chunks use the same object type, as OpenAI does)."""

    endpoint = "completions"

    def __init__(self, model: str, fingerprint: str | None = None):
        self.id = f"cmpl-{uuid.uuid4().hex[:24]}"
        self.model = model
        self.created = int(time.time())
        self.fingerprint = fingerprint

    def _body(self, choices: list[CompletionChoice], usage: Usage | None = None) -> dict[str, Any]:
        return dump(Completion(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage,
                               system_fingerprint=self.fingerprint))

    def head(self) -> dict[str, Any] | None:
        return None

    def delta(self, text: str) -> dict[str, Any]:
        return self._body([CompletionChoice(text=text)])

    def final(self, result: GenerationResult) -> dict[str, Any]:
        return self._body([CompletionChoice(text="", finish_reason=result.finish_reason)])

    def usage(self, result: GenerationResult) -> dict[str, Any]:
        return self._body([], usage_of(result))

    def full(self, result: GenerationResult) -> dict[str, Any]:
        return self._body([CompletionChoice(text=result.output_text, finish_reason=result.finish_reason)],
                          usage_of(result))


Renderer = ChatRenderer | CompletionRenderer
