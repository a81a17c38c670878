"""OpenAI response bodies and SSE chunks for chat and text completions, built from engine results as the JSON objects
OpenAI sends (field order included). One renderer per HTTP request, for n choices; tool calls are read out of each
choice's text by a ToolCallParser and streamed as OpenAI streams them; log-probabilities come in a full body's choice,
or a streamed choice's final chunk."""
from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Callable
from itertools import accumulate
from typing import Any

from .. import __version__
from ..results import GenerationResult
from .toolcalls import ToolCallParser, parse_reply

_FINGERPRINT = f"kvboost-{__version__}"  # every body's system_fingerprint
Decode = Callable[[int], str]  # token id -> its text
Body = dict[str, Any]


def usage_of(results: list[GenerationResult], predicted: bool = False) -> Body:
    """The prompt counts once for n choices, the completions add up; a prediction's drafts are reported as OpenAI
    does (accepted: kept; rejected: verified and discarded)."""
    first = results[0]
    completion = sum(r.generated_tokens for r in results)
    usage: Body = {"prompt_tokens": first.prompt_tokens, "completion_tokens": completion,
                   "total_tokens": first.prompt_tokens + completion,
                   "prompt_tokens_details": {"cached_tokens": first.cached_tokens}}
    if predicted:
        accepted = sum(r.accepted_tokens for r in results)
        usage["completion_tokens_details"] = {
            "accepted_prediction_tokens": accepted,
            "rejected_prediction_tokens": sum(r.draft_tokens for r in results) - accepted,
            "reasoning_tokens": 0, "audio_tokens": 0}
    return usage


def _logprob(x: float) -> float | None:
    return x if math.isfinite(x) else None  # JSON has no -inf: null, as OpenAI-compatible servers send it


def _entry(decode: Decode, token: int, logprob: float) -> Body:
    text = decode(token)
    return {"token": text, "logprob": _logprob(logprob), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(result: GenerationResult, decode: Decode) -> Body | None:
    if result.logprobs is None:
        return None
    return {"content": [dict(_entry(decode, t.token, t.logprob),
                             top_logprobs=[_entry(decode, a, lp) for a, lp in t.top]) for t in result.logprobs]}


def completion_logprobs(result: GenerationResult, decode: Decode) -> Body | None:
    """The legacy shape: tokens, token_logprobs, top_logprobs (token text -> logprob), text_offset."""
    if result.logprobs is None:
        return None
    tokens = [decode(t.token) for t in result.logprobs]
    offsets = list(accumulate(map(len, tokens), initial=0))[:-1]
    return {"tokens": tokens, "token_logprobs": [_logprob(t.logprob) for t in result.logprobs],
            "top_logprobs": [{decode(a): _logprob(lp) for a, lp in t.top} for t in result.logprobs],
            "text_offset": offsets}


def _choice(index: int, key: str, value: Any, finish_reason: str | None = None, logprobs: Body | None = None) -> Body:
    return {"index": index, key: value, "finish_reason": finish_reason, "logprobs": logprobs}


def model_card(model_id: str, created: int) -> Body:
    """A /v1/models entry."""
    return {"id": model_id, "object": "model", "created": created, "owned_by": "kvboost"}


class _RendererBase:
    id_prefix = ""
    object_name = ""  # the body's "object"
    done = "data: [DONE]\n\n"  # what ends a stream

    @staticmethod
    def frame(body: Body) -> str:
        """One streamed body as SSE text."""
        return f"data: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"

    @staticmethod
    def error(body: Body) -> Body:
        """An error body as it travels in a stream (the openai SDK raises it)."""
        return body

    def __init__(self, model: str, decode: Decode, n: int = 1):
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex[:24]}"
        self.model, self.created, self.decode, self.n = model, int(time.time()), decode, n

    def _body(self, choices: list[Body], usage: Body | None = None, object_name: str | None = None) -> Body:
        return {"id": self.id, "object": object_name or self.object_name, "created": self.created, "model": self.model,
                "choices": choices, "usage": usage, "system_fingerprint": _FINGERPRINT}


class ChatRenderer(_RendererBase):
    """chat.completion and chat.completion.chunk bodies for one request (n choices). A chunk's delta holds only the
    fields that changed, as OpenAI streams it, so the last delta is {}."""

    endpoint, id_prefix, object_name = "chat", "chatcmpl", "chat.completion"

    def __init__(self, model: str, decode: Decode, n: int = 1, tool_parse: str = "none", predicted: bool = False):
        super().__init__(model, decode, n)
        self.predicted, self.tool_parse = predicted, tool_parse
        self._parsers = [ToolCallParser(tool_parse) if tool_parse != "none" else None for _ in range(n)]
        self._call_ids: dict[tuple[int, int], str] = {}

    def _delta(self, index: int, delta: Body, finish_reason: str | None = None, logprobs: Body | None = None) -> Body:
        return self._body([_choice(index, "delta", delta, finish_reason, logprobs)], None, "chat.completion.chunk")

    def _call_id(self, choice: int, call: int) -> str:
        return self._call_ids.setdefault((choice, call), f"call_{uuid.uuid4().hex[:24]}")

    def head(self) -> list[Body]:
        return [self._delta(i, {"role": "assistant", "content": ""}) for i in range(self.n)]

    def delta(self, text: str, index: int = 0) -> list[Body]:
        parser = self._parsers[index]
        if parser is None:
            return [self._delta(index, {"content": text})]
        return [self._event_chunk(index, e) for e in parser.feed(text)]

    def _event_chunk(self, index: int, event: tuple) -> Body:
        if event[0] == "content":
            return self._delta(index, {"content": event[1]})
        if event[0] == "call":
            call = {"index": event[1], "id": self._call_id(index, event[1]), "type": "function",
                    "function": {"name": event[2], "arguments": ""}}
        else:
            call = {"index": event[1], "function": {"arguments": event[2]}}
        return self._delta(index, {"tool_calls": [call]})

    def final(self, result: GenerationResult, index: int = 0) -> list[Body]:
        parser = self._parsers[index]
        chunks = [self._event_chunk(index, e) for e in parser.finish()] if parser is not None else []
        chunks.append(self._delta(index, {}, self._finish_reason(result, parser), chat_logprobs(result, self.decode)))
        return chunks

    @staticmethod
    def _finish_reason(result: GenerationResult, parser: ToolCallParser | None) -> str:
        # As OpenAI: "tool_calls" when the reply called tools and ended on its own; "length" when cut short.
        return "tool_calls" if parser is not None and parser.calls and result.finish_reason == "stop" \
            else result.finish_reason

    def usage(self, results: list[GenerationResult]) -> Body:
        return self._body([], usage_of(results, self.predicted), "chat.completion.chunk")

    def full(self, results: list[GenerationResult]) -> Body:
        choices = []
        for i, result in enumerate(results):
            parser = parse_reply(result.output_text, self.tool_parse) if self.tool_parse != "none" else None
            calls = [{"id": self._call_id(i, j), "type": "function",
                      "function": {"name": c.name, "arguments": c.arguments}}
                     for j, c in enumerate(parser.calls)] if parser is not None else []
            content = parser.content if parser is not None else result.output_text
            message: Body = {"role": "assistant", "content": content if content or not calls else None}
            if calls:
                message["tool_calls"] = calls
            choices.append(_choice(i, "message", message, self._finish_reason(result, parser),
                                   chat_logprobs(result, self.decode)))
        return self._body(choices, usage_of(results, self.predicted))


class CompletionRenderer(_RendererBase):
    """text_completion bodies (streamed chunks use the same object type, as OpenAI does)."""

    endpoint, id_prefix, object_name = "completions", "cmpl", "text_completion"

    def head(self) -> list[Body]:
        return []

    def delta(self, text: str, index: int = 0) -> list[Body]:
        return [self._body([_choice(index, "text", text)])]

    def final(self, result: GenerationResult, index: int = 0) -> list[Body]:
        return [self._body([_choice(index, "text", "", result.finish_reason,
                                    completion_logprobs(result, self.decode))])]

    def usage(self, results: list[GenerationResult]) -> Body:
        return self._body([], usage_of(results))

    def full(self, results: list[GenerationResult]) -> Body:
        return self._body([_choice(i, "text", r.output_text, r.finish_reason, completion_logprobs(r, self.decode))
                           for i, r in enumerate(results)], usage_of(results))


Renderer = ChatRenderer | CompletionRenderer
