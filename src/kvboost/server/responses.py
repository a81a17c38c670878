"""The Responses API (`/v1/responses`) over the chat machinery: a request becomes a chat completion request
(instructions, the stored conversation of `previous_response_id`, the input items, tools, `text.format`), runs as one,
and is rendered as a `response` object, or as the event stream the openai SDK's `responses.stream` reads.

Stored responses (store: true, the default) keep the conversation they end as chat messages, bounded (oldest out
first), so a follow-up naming one re-renders the same prefix and its K/V is reused like any other prefix. As OpenAI
does, `instructions` belong to one request: a follow-up does not inherit them.
"""
from __future__ import annotations

import json
import threading
import time
import uuid
from collections import OrderedDict
from typing import Any

from ..results import GenerationResult
from .errors import APIError, unsupported, validated
from .render import Body
from .schema import ChatCompletionRequest, ResponsesRequest
from .toolcalls import ToolCallParser, parse_reply

MAX_STORED = 1024  # responses kept for previous_response_id / GET, oldest dropped first
_CHAT_FIELDS = ("temperature", "top_p", "seed", "user", "stream", "parallel_tool_calls")


class ResponseStore:
    """Finished responses by id: the body (GET /v1/responses/{id}) and the conversation it ends, as chat messages."""

    def __init__(self, capacity: int = MAX_STORED):
        self.capacity = capacity
        self._items: OrderedDict[str, tuple[Body, list[Body]]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, body: Body, messages: list[Body]) -> None:
        with self._lock:
            self._items[body["id"]] = (body, messages)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def get(self, response_id: str) -> tuple[Body, list[Body]]:
        with self._lock:
            found = self._items.get(response_id)
        if found is None:
            raise APIError(404, f"Response with id '{response_id}' not found.", param="response_id",
                           code="response_not_found")
        return found

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        with self._lock:
            self._items.pop(response_id, None)


# ---- request -> chat request -------------------------------------------------------------------------------
def _text_of(content: Any, param: str) -> str:
    """A message's content: text, or parts of input_text / output_text / text."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, "content must be text or a list of text parts", param=param, code="invalid_value")
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise unsupported(f"content part of type {kind!r}: this server reads text parts only (input_text)",
                              f"{param}.{i}")
    return "".join(part["text"] for part in content)


def input_messages(items: str | list[Any]) -> list[Body]:
    """The input as chat messages: text is one user turn; items are messages, function calls (merged into the
    assistant turn they follow) and function call outputs."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[Body] = []
    for i, item in enumerate(items):
        param = f"input.{i}"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise APIError(400, f"message role {role!r}", param=f"{param}.role", code="invalid_value")
            messages.append({"role": role, "content": _text_of(item.get("content"), f"{param}.content")})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            if messages and messages[-1]["role"] == "assistant" and not messages[-1].get("content"):
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": _text_of(item.get("output"), f"{param}.output")})
        else:
            raise unsupported(f"input item of type {kind!r}: this server reads messages, function_call and "
                              "function_call_output items", param)
    return messages


def _tools(req: ResponsesRequest) -> Body:
    out: Body = {}
    if req.tools is not None:
        for i, tool in enumerate(req.tools):
            if tool.get("type") != "function":
                raise unsupported(f"tool type {tool.get('type')!r}: this server calls functions only", f"tools.{i}")
        keys = ("name", "description", "parameters", "strict")
        out["tools"] = [{"type": "function", "function": {k: t[k] for k in keys if t.get(k) is not None}}
                        for t in req.tools]
    choice = req.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise unsupported(f"tool_choice type {choice.get('type')!r}: name a function", "tool_choice")
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    if choice is not None:
        out["tool_choice"] = choice
    return out


def _response_format(text: Body | None) -> Body | None:
    fmt = (text or {}).get("format")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict", "description")
                                                       if k in fmt}}
    return fmt  # json_object, or a type the chat path refuses with the reason


def to_chat(req: ResponsesRequest, store: ResponseStore) -> tuple[ChatCompletionRequest, list[Body]]:
    """The chat completion request a Responses request runs as, and the conversation without its instructions."""
    if req.background:
        raise unsupported("background responses are not supported by this server", "background")
    if req.reasoning and req.reasoning.get("effort") is not None:
        raise unsupported("reasoning effort is not supported with this model", "reasoning")
    if req.truncation not in (None, "disabled"):
        raise unsupported("truncation 'auto' is not supported: a conversation longer than the context is refused",
                          "truncation")
    if req.top_logprobs or req.include:
        raise unsupported("include / top_logprobs are not supported on /v1/responses", "include")
    history = store.get(req.previous_response_id)[1] if req.previous_response_id else []
    conversation = history + input_messages(req.input)
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    body: Body = {**(req.model_extra or {}), "model": req.model, "messages": system + conversation, **_tools(req)}
    optional = {**{k: getattr(req, k) for k in _CHAT_FIELDS}, "max_completion_tokens": req.max_output_tokens,
                "response_format": _response_format(req.text)}
    body.update({k: v for k, v in optional.items() if v is not None})
    return validated(ChatCompletionRequest, body), conversation


# ---- results -> response bodies and events -------------------------------------------------------------------
def _usage(result: GenerationResult) -> Body:
    return {"input_tokens": result.prompt_tokens, "input_tokens_details": {"cached_tokens": result.cached_tokens},
            "output_tokens": result.generated_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": result.prompt_tokens + result.generated_tokens}


class ResponseRenderer:
    """One /v1/responses request: the response object, or its events (each with a sequence number)."""

    endpoint = "responses"

    def __init__(self, model: str, req: ResponsesRequest, conversation: list[Body], store: ResponseStore,
                 tool_parse: str = "none"):
        self.id, self.created = f"resp_{uuid.uuid4().hex[:24]}", int(time.time())
        self.model, self.req, self.conversation, self.store = model, req, conversation, store
        self.tool_parse = tool_parse
        self.parser = ToolCallParser(tool_parse) if tool_parse != "none" else None
        self.sequence = 0
        self.items: list[Body] = []  # output items so far (streaming)
        self.open: Body | None = None  # the item being streamed

    # the Renderer protocol (server/app.py)
    def frame(self, event: Body) -> str:
        return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False, separators=(',', ':'))}\n\n"

    done = None  # no [DONE]: response.completed ends the stream

    def error(self, body: Body) -> Body:
        err = body["error"]
        return self._event("error", code=err.get("code"), message=err["message"], param=err.get("param"))

    def head(self) -> list[Body]:
        snapshot = self._body("in_progress", [], None)
        return [self._event("response.created", response=snapshot),
                self._event("response.in_progress", response=snapshot)]

    def delta(self, text: str, index: int = 0) -> list[Body]:
        if self.parser is None:
            return self._text(text)
        return [body for event in self.parser.feed(text) for body in self._parsed(event)]

    def final(self, result: GenerationResult, index: int = 0) -> list[Body]:
        parsed = self.parser.finish() if self.parser is not None else []
        events = [body for event in parsed for body in self._parsed(event)] + self._close()
        body = self._finished(result, self.items)
        return events + [self._event(f"response.{body['status']}", response=body)]  # completed, or incomplete

    def full(self, results: list[GenerationResult]) -> Body:
        result = results[0]
        parsed = parse_reply(result.output_text, self.tool_parse) if self.tool_parse != "none" else None
        text = parsed.content if parsed is not None else result.output_text
        items = [self._message(text, "completed")] if text or parsed is None or not parsed.calls else []
        items += [self._call(call.name, call.arguments, "completed") for call in (parsed.calls if parsed else [])]
        return self._finished(result, items)

    # pieces
    def _event(self, kind: str, **fields: Any) -> Body:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}

    def _body(self, status: str, output: list[Body], result: GenerationResult | None) -> Body:
        req = self.req
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "model": self.model, "output": output, "error": None, "incomplete_details": incomplete,
                "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
                "previous_response_id": req.previous_response_id, "temperature": req.temperature,
                "top_p": req.top_p, "tools": req.tools or [], "tool_choice": req.tool_choice or "auto",
                "parallel_tool_calls": req.parallel_tool_calls is not False,
                "text": req.text or {"format": {"type": "text"}}, "metadata": req.metadata or {},
                "store": req.store is not False, "truncation": "disabled", "user": req.user,
                "usage": _usage(result) if result is not None else None}

    def _finished(self, result: GenerationResult, items: list[Body]) -> Body:
        body = self._body("incomplete" if result.finish_reason == "length" else "completed", items, result)
        if body["store"]:
            self.store.put(body, self.conversation + [_as_chat(items)])
        return body

    def _message(self, text: str, status: str) -> Body:
        return {"type": "message", "id": f"msg_{uuid.uuid4().hex[:24]}", "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}

    @staticmethod
    def _call(name: str, arguments: str, status: str) -> Body:
        return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex[:24]}",
                "call_id": f"call_{uuid.uuid4().hex[:24]}", "name": name, "arguments": arguments, "status": status}

    def _parsed(self, event: tuple) -> list[Body]:
        if event[0] == "content":
            return self._text(event[1])
        if event[0] == "call":
            events = self._close()
            self.open = self._call(event[2], "", "in_progress")
            return events + [self._event("response.output_item.added", output_index=len(self.items),
                                         item=dict(self.open))]
        self.open["arguments"] += event[2]
        return [self._event("response.function_call_arguments.delta", item_id=self.open["id"],
                            output_index=len(self.items), delta=event[2])]

    def _text(self, text: str) -> list[Body]:
        events: list[Body] = []
        if self.open is None or self.open["type"] != "message":
            events += self._close()
            self.open = self._message("", "in_progress")
            index = len(self.items)
            events += [self._event("response.output_item.added", output_index=index,
                                   item={**self.open, "content": []}),
                       self._event("response.content_part.added", item_id=self.open["id"], output_index=index,
                                   content_index=0, part=dict(self.open["content"][0]))]
        self.open["content"][0]["text"] += text
        return events + [self._event("response.output_text.delta", item_id=self.open["id"],
                                     output_index=len(self.items), content_index=0, delta=text, logprobs=[])]

    def _close(self) -> list[Body]:
        item, self.open = self.open, None
        if item is None:
            return []
        index = len(self.items)
        item["status"] = "completed"
        self.items.append(item)
        if item["type"] == "message":
            part = item["content"][0]
            return [self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                content_index=0, text=part["text"], logprobs=[]),
                    self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                content_index=0, part=part),
                    self._event("response.output_item.done", output_index=index, item=item)]
        return [self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                            name=item["name"], arguments=item["arguments"]),
                self._event("response.output_item.done", output_index=index, item=item)]


def _as_chat(items: list[Body]) -> Body:
    """A response's output items as the assistant chat turn they were."""
    text = "".join(part["text"] for item in items if item["type"] == "message" for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in items if item["type"] == "function_call"]
    return {"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}
