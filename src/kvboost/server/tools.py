"""Tools in a chat request: checking them, putting them in the prompt, and the grammar a call must follow. Templates
without `tools` get a generic format: a system message lists the functions, calls are <tool_call>{...}</tool_call>
lines, results are <tool_response> user turns."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ..decoding.grammar import OutputFormat, json_schema_format, structural_tag_format
from .errors import invalid
from .schema import ChatMessage, NamedToolChoice, Tool

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"


@dataclass
class ToolSetup:
    """What a request's tools mean for its prompt and output; parse: "none" | "call" | "tagged"."""

    functions: list[dict[str, Any]] = field(default_factory=list)  # {"name", "description", "parameters"}
    choice: str = "none"
    output_format: OutputFormat | None = None
    parse: str = "none"


def setup_tools(tools: list[Tool] | None, tool_choice: str | NamedToolChoice | None,
                parallel_tool_calls: bool | None = None) -> ToolSetup:
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise invalid("tool_choice needs tools: the request has none", "tool_choice")
        return ToolSetup()
    functions = []
    for i, tool in enumerate(tools):
        params = tool.function.parameters if tool.function.parameters is not None else {"type": "object"}
        if params.get("type", "object") != "object":
            raise invalid(f"tools[{i}].function.parameters must be a JSON Schema of type object",
                          f"tools.{i}.function.parameters")
        functions.append({"name": tool.function.name, "description": tool.function.description or "",
                          "parameters": params})
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise invalid("tools: function names must be unique", "tools")
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise invalid(f"tool_choice names function {choice.function.name!r}, which is not among the request's "
                          f"tools ({', '.join(names)})", "tool_choice.function.name")
        chosen = [f for f in functions if f["name"] == choice.function.name]
        return ToolSetup(functions, "named", json_schema_format(_call_schema(chosen), "tools"), "call")
    if choice == "none":
        return ToolSetup(functions, "none")
    if choice == "required":
        return ToolSetup(functions, "required", json_schema_format(_call_schema(functions), "tools"), "call")
    tags = [{"begin": f'{TOOL_OPEN}{{"name": "{f["name"]}", "arguments": ', "schema": f["parameters"],
             "end": "}" + TOOL_CLOSE} for f in functions]
    spec = {"triggers": [TOOL_OPEN], "tags": tags, "stop_after_first": parallel_tool_calls is False}
    return ToolSetup(functions, "auto", structural_tag_format(spec), "tagged")


def _call_schema(functions: list[dict[str, Any]]) -> dict[str, Any]:
    options = [{"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
                "required": ["name", "arguments"], "additionalProperties": False} for f in functions]
    return options[0] if len(options) == 1 else {"anyOf": options}


def render_messages(messages: list[ChatMessage], texts: list[str], setup: ToolSetup,
                    native: bool) -> list[dict[str, Any]]:
    """Chat messages for the template, tool turns included; tool results must answer earlier calls (400 otherwise)."""
    calls: dict[str, str] = {}  # tool_call id -> function name, from assistant turns so far
    out: list[dict[str, Any]] = []
    for i, (m, text) in enumerate(zip(messages, texts)):
        role = "system" if m.role == "developer" else m.role
        if role == "function":
            raise invalid(f"messages[{i}]: the deprecated 'function' role is not supported; use 'tool' messages "
                          "with tool_call_id", f"messages.{i}.role")
        if m.tool_calls and role != "assistant":
            raise invalid(f"messages[{i}]: only assistant messages carry tool_calls", f"messages.{i}.tool_calls")
        if role == "assistant" and m.tool_calls:
            parsed = []
            for j, call in enumerate(m.tool_calls):
                try:
                    arguments = json.loads(call.function.arguments or "{}")
                except ValueError as exc:
                    raise invalid(f"messages[{i}].tool_calls[{j}].function.arguments is not valid JSON: {exc}",
                                  f"messages.{i}.tool_calls.{j}.function.arguments") from None
                calls[call.id] = call.function.name
                parsed.append({"name": call.function.name, "arguments": arguments})
            if native:
                out.append({"role": "assistant", "content": text,
                            "tool_calls": [{"type": "function", "function": p} for p in parsed]})
            else:
                lines = [text] if text else []
                lines += [TOOL_OPEN + json.dumps(p, ensure_ascii=False) + TOOL_CLOSE for p in parsed]
                out.append({"role": "assistant", "content": "\n".join(lines)})
        elif role == "tool":
            if not m.tool_call_id:
                raise invalid(f"messages[{i}]: a tool message needs tool_call_id", f"messages.{i}.tool_call_id")
            if m.tool_call_id not in calls:
                raise invalid(f"messages[{i}].tool_call_id {m.tool_call_id!r} answers no tool call made by an "
                              "earlier assistant message", f"messages.{i}.tool_call_id")
            name = calls[m.tool_call_id]
            out.append({"role": "tool", "content": text, "name": name, "tool_call_id": m.tool_call_id} if native
                       else {"role": "user", "content": f'<tool_response name="{name}">\n{text}\n</tool_response>'})
        else:
            out.append({"role": role, "content": text})
    if not setup.functions or native:
        return out
    listing = json.dumps(setup.functions, ensure_ascii=False)
    prompt = ("You can call these functions (each with a JSON Schema of its parameters):\n" + listing +
              f'\nTo call one, answer with {TOOL_OPEN}{{"name": "<function name>", "arguments": {{<arguments as '
              f"JSON>}}}}{TOOL_CLOSE}. Otherwise answer normally.")
    if out and out[0]["role"] == "system":
        return [{"role": "system", "content": out[0]["content"] + "\n\n" + prompt}] + out[1:]
    return [{"role": "system", "content": prompt}] + out
