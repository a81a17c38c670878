"""Reading tool calls out of generated text as it streams, the way OpenAI streams them. Events: ("content", text) |
("call", index, name) | ("arguments", index, text). parse="call": the output is one {"name", "arguments"} object;
"tagged": free text with <tool_call>...</tool_call> segments. Text that could still grow into a marker is held back."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from ..sampling import partial_suffix
from .tools import TOOL_CLOSE, TOOL_OPEN

# The call object's head up to its arguments; (?=\S): the whitespace after the colon is whole.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\S)')
Event = tuple


@dataclass
class ParsedCall:
    name: str
    arguments: str = ""


@dataclass
class ToolCallParser:
    parse: str  # "call" | "tagged"
    calls: list[ParsedCall] = field(default_factory=list)
    content: str = ""
    _buf: str = ""
    _in_call: bool = False
    _head_done: bool = False

    def __post_init__(self) -> None:
        self._in_call = self.parse == "call"
        self._end = "}" if self.parse == "call" else "}" + TOOL_CLOSE

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        return self._drain(final=False)

    def finish(self) -> list[Event]:
        return self._drain(final=True)

    def _drain(self, final: bool) -> list[Event]:
        events: list[Event] = []
        while True:
            before = (len(self._buf), self._in_call, self._head_done)
            if not self._in_call:
                events += self._text(final)
            elif not self._head_done:
                events += self._head(final)
            else:
                events += self._arguments(final)
            if (len(self._buf), self._in_call, self._head_done) == before:
                return events

    def _text(self, final: bool) -> list[Event]:
        at = self._buf.find(TOOL_OPEN)
        if at >= 0:
            text, self._buf = self._buf[:at], self._buf[at + len(TOOL_OPEN):]
            self._in_call, self._head_done = True, False
        else:
            keep = 0 if final else partial_suffix(self._buf, TOOL_OPEN)
            text, self._buf = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep:]
        self.content += text
        return [("content", text)] if text else []

    def _head(self, final: bool) -> list[Event]:
        m = _HEAD.match(self._buf)
        if m is None:
            if final and self._buf:  # not a call after all (cut short, or the model wrote something else)
                text, self._buf, self._in_call = self._buf, "", False
                opener = TOOL_OPEN if self.parse == "tagged" else ""
                self.content += opener + text
                return [("content", opener + text)]
            return []
        try:
            name = json.loads(f'"{m.group(1)}"')
        except ValueError:
            name = m.group(1)
        self.calls.append(ParsedCall(name))
        self._buf, self._head_done = self._buf[m.end():], True
        return [("call", len(self.calls) - 1, name)]

    def _arguments(self, final: bool) -> list[Event]:
        call = self.calls[-1]
        at = self._buf.find(self._end) if self.parse == "tagged" else -1
        if at >= 0:
            piece, self._buf, self._in_call = self._buf[:at], self._buf[at + len(self._end):], False
        elif final:
            piece, self._buf = self._buf, ""
            if self.parse == "call" and piece.rstrip().endswith("}"):
                piece = piece.rstrip()[:-1]  # the wrapper object's closing brace
            self._in_call = False
        else:
            keep = len(self._end) if self.parse == "call" else partial_suffix(self._buf, self._end, whole=True)
            piece, self._buf = self._buf[: max(0, len(self._buf) - keep)], self._buf[max(0, len(self._buf) - keep):]
        call.arguments += piece
        return [("arguments", len(self.calls) - 1, piece)] if piece else []


def parse_reply(text: str, parse: str) -> ToolCallParser:
    """The whole reply parsed at once."""
    parser = ToolCallParser(parse)
    parser.feed(text)
    parser.finish()
    return parser
