"""OpenAI response bodies and SSE chunks for chat and text completions, built from engine results. One renderer per
HTTP request, for n choices; tool calls are read out of each choice's text by a ToolCallParser and streamed as OpenAI
streams them; log-probabilities come in a full body's choice, or a streamed choice's final chunk."""
from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from itertools import accumulate
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
    CompletionTokensDetails,
    PromptTokensDetails,
    ResponseFunctionCall,
    ResponseToolCall,
    Usage,
    dump,
)
from .toolcalls import ToolCallParser, parse_reply

DONE = "data: [DONE]\n\n"
Decode = Callable[[int], str]  # token id -> its text


def sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


def usage_of(results: list[GenerationResult], predicted: bool = False) -> Usage:
    """The prompt counts once for n choices, the completions add up; a prediction's drafts are reported as OpenAI
    does (accepted: kept; rejected: verified and discarded)."""
    first = results[0]
    completion = sum(r.generated_tokens for r in results)
    details = None
    if predicted:
        accepted = sum(r.accepted_tokens for r in results)
        details = CompletionTokensDetails(accepted_prediction_tokens=accepted,
                                          rejected_prediction_tokens=sum(r.draft_tokens for r in results) - accepted)
    return Usage(prompt_tokens=first.prompt_tokens, completion_tokens=completion,
                 total_tokens=first.prompt_tokens + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=first.cached_tokens),
                 completion_tokens_details=details)


def _entry(decode: Decode, token: int, logprob: float) -> dict[str, Any]:
    text = decode(token)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(result: GenerationResult, decode: Decode) -> dict[str, Any] | None:
    if result.logprobs is None:
        return None
    return {"content": [dict(_entry(decode, t.token, t.logprob),
                             top_logprobs=[_entry(decode, a, lp) for a, lp in t.top]) for t in result.logprobs]}


def completion_logprobs(result: GenerationResult, decode: Decode) -> dict[str, Any] | None:
    """The legacy shape: tokens, token_logprobs, top_logprobs (token text -> logprob), text_offset."""
    if result.logprobs is None:
        return None
    tokens = [decode(t.token) for t in result.logprobs]
    offsets = list(accumulate(map(len, tokens), initial=0))[:-1]
    return {"tokens": tokens, "token_logprobs": [t.logprob for t in result.logprobs],
            "top_logprobs": [{decode(a): lp for a, lp in t.top} for t in result.logprobs], "text_offset": offsets}


class _RendererBase:
    id_prefix = ""

    def __init__(self, model: str, fingerprint: str | None = None, *, decode: Decode | None = None, n: int = 1):
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex[:24]}"
        self.model, self.created, self.fingerprint = model, int(time.time()), fingerprint
        self.decode, self.n = decode or str, n


class ChatRenderer(_RendererBase):
    """chat.completion and chat.completion.chunk bodies for one request (n choices)."""

    endpoint, id_prefix = "chat", "chatcmpl"

    def __init__(self, model: str, fingerprint: str | None = None, *, decode: Decode | None = None,
                 tool_parse: str = "none", n: int = 1, predicted: bool = False):
        super().__init__(model, fingerprint, decode=decode, n=n)
        self.predicted, self.tool_parse = predicted, tool_parse
        self._parsers = [ToolCallParser(tool_parse) if tool_parse != "none" else None for _ in range(n)]
        self._call_ids: dict[tuple[int, int], str] = {}

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> dict[str, Any]:
        return dump(ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices,
                                        usage=usage, system_fingerprint=self.fingerprint))

    def _call_id(self, choice: int, call: int) -> str:
        return self._call_ids.setdefault((choice, call), f"call_{uuid.uuid4().hex[:24]}")

    def head(self) -> list[dict[str, Any]]:
        return [self._chunk([ChatChunkChoice(index=i, delta=ChunkDelta(role="assistant", content=""))])
                for i in range(self.n)]

    def delta(self, text: str, index: int = 0) -> list[dict[str, Any]]:
        parser = self._parsers[index]
        if parser is None:
            return [self._chunk([ChatChunkChoice(index=index, delta=ChunkDelta(content=text))])]
        return [self._event_chunk(index, e) for e in parser.feed(text)]

    def _event_chunk(self, index: int, event: tuple) -> dict[str, Any]:
        if event[0] == "content":
            delta = ChunkDelta(content=event[1])
        elif event[0] == "call":
            call = ResponseToolCall(index=event[1], id=self._call_id(index, event[1]), type="function",
                                    function=ResponseFunctionCall(name=event[2], arguments=""))
            delta = ChunkDelta(tool_calls=[call])
        else:
            delta = ChunkDelta(tool_calls=[ResponseToolCall(index=event[1],
                                                            function=ResponseFunctionCall(arguments=event[2]))])
        return self._chunk([ChatChunkChoice(index=index, delta=delta)])

    def final(self, result: GenerationResult, index: int = 0) -> list[dict[str, Any]]:
        parser = self._parsers[index]
        chunks = [self._event_chunk(index, e) for e in parser.finish()] if parser is not None else []
        reason = self._finish_reason(result, parser)
        chunks.append(self._chunk([ChatChunkChoice(index=index, delta=ChunkDelta(), finish_reason=reason,
                                                   logprobs=chat_logprobs(result, self.decode))]))
        return chunks

    @staticmethod
    def _finish_reason(result: GenerationResult, parser: ToolCallParser | None) -> str:
        # As OpenAI: "tool_calls" when the reply called tools and ended on its own; "length" when cut short.
        return "tool_calls" if parser is not None and parser.calls and result.finish_reason == "stop" \
            else result.finish_reason

    def usage(self, results: list[GenerationResult]) -> dict[str, Any]:
        return self._chunk([], usage_of(results, self.predicted))

    def full(self, results: list[GenerationResult]) -> dict[str, Any]:
        choices = []
        for i, result in enumerate(results):
            parser = parse_reply(result.output_text, self.tool_parse) if self.tool_parse != "none" else None
            calls = [ResponseToolCall(id=self._call_id(i, j), type="function",
                                      function=ResponseFunctionCall(name=c.name, arguments=c.arguments))
                     for j, c in enumerate(parser.calls)] if parser is not None else []
            content = parser.content if parser is not None else result.output_text
            message = AssistantMessage(content=content if content or not calls else None, tool_calls=calls or None)
            choices.append(ChatChoice(index=i, message=message, finish_reason=self._finish_reason(result, parser),
                                      logprobs=chat_logprobs(result, self.decode)))
        return dump(ChatCompletion(id=self.id, created=self.created, model=self.model, choices=choices,
                                   usage=usage_of(results, self.predicted), system_fingerprint=self.fingerprint))


class CompletionRenderer(_RendererBase):
    """text_completion bodies (streamed chunks use the same object type, as OpenAI does)."""

    endpoint, id_prefix = "completions", "cmpl"

    def _body(self, choices: list[CompletionChoice], usage: Usage | None = None) -> dict[str, Any]:
        return dump(Completion(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage,
                               system_fingerprint=self.fingerprint))

    def head(self) -> list[dict[str, Any]]:
        return []

    def delta(self, text: str, index: int = 0) -> list[dict[str, Any]]:
        return [self._body([CompletionChoice(index=index, text=text)])]

    def final(self, result: GenerationResult, index: int = 0) -> list[dict[str, Any]]:
        return [self._body([CompletionChoice(index=index, text="", finish_reason=result.finish_reason,
                                             logprobs=completion_logprobs(result, self.decode))])]

    def usage(self, results: list[GenerationResult]) -> dict[str, Any]:
        return self._body([], usage_of(results))

    def full(self, results: list[GenerationResult]) -> dict[str, Any]:
        return self._body([CompletionChoice(index=i, text=r.output_text, finish_reason=r.finish_reason,
                                            logprobs=completion_logprobs(r, self.decode))
                           for i, r in enumerate(results)], usage_of(results))


Renderer = ChatRenderer | CompletionRenderer
