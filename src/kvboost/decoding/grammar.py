"""Output formats (JSON object, JSON schema, regex, EBNF grammar) compiled once per tokenizer and cached. The library
(xgrammar, the `structured` extra) is imported only when a format is compiled."""
from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import InvalidRequestError, KVBoostError
from .closing import ClosingVocab, closing_vocab

FORMAT_KINDS = ("json_object", "json_schema", "regex", "grammar", "structural_tag")
# Whitespace between JSON tokens, at most this many characters: models write indented JSON, but not endless newlines.
MAX_JSON_WHITESPACE = 20


class GrammarError(InvalidRequestError):
    """The schema, regex or grammar cannot be compiled (the message says what the grammar library found)."""


class StructuredOutputUnavailableError(KVBoostError, ImportError):
    """Constrained decoding needs the grammar library: the structured extra (install_source.pip_install_extra)."""


@dataclass(frozen=True)
class OutputFormat:
    """What the output must match; `source` keys the cache (a schema as compact JSON, key order kept)."""

    kind: str
    source: str = ""
    param: str = "response_format"  # the argument a compile error is reported against

    @property
    def key(self) -> tuple[str, str]:
        return self.kind, self.source


def parse_output_format(response_format: Any = None, regex: str | None = None,
                        grammar: str | None = None) -> OutputFormat | None:
    """The one format a request asks for, or None for free text. response_format: OpenAI's shape (a bare schema
    accepted) or a pydantic model class; regex: matches the whole output; grammar: EBNF (root rule `root`)."""
    text = isinstance(response_format, dict) and response_format.get("type") == "text"  # free text: not a format
    given = [name for name, v in (("response_format", response_format is not None and not text), ("regex", regex),
                                  ("grammar", grammar)) if v]
    if len(given) > 1:
        raise InvalidRequestError(f"pass at most one of response_format, regex and grammar (got {', '.join(given)})",
                                  given[1])
    if regex is not None:
        if not isinstance(regex, str) or not regex:
            raise InvalidRequestError("regex must be a non-empty string", "regex")
        return OutputFormat("regex", regex, "regex")
    if grammar is not None:
        if not isinstance(grammar, str) or not grammar.strip():
            raise InvalidRequestError("grammar must be a non-empty EBNF string", "grammar")
        return OutputFormat("grammar", grammar, "grammar")
    return _parse_response_format(response_format)


def _parse_response_format(fmt: Any) -> OutputFormat | None:
    if fmt is None:
        return None
    if isinstance(fmt, type) and hasattr(fmt, "model_json_schema"):  # a pydantic model class
        return json_schema_format(fmt.model_json_schema())
    if not isinstance(fmt, dict):
        raise InvalidRequestError(f"response_format must be an object, got {type(fmt).__name__}", "response_format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return OutputFormat("json_object")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise InvalidRequestError("response_format.json_schema must be an object holding the schema",
                                      "response_format.json_schema")
        schema = spec.get("schema", spec if "name" not in spec else None)
        if schema is None:  # OpenAI allows it: any JSON object then
            return OutputFormat("json_object")
        return json_schema_format(schema, "response_format.json_schema.schema")
    raise InvalidRequestError(f"response_format type must be one of text, json_object, json_schema; got {kind!r}",
                              "response_format.type")


def json_schema_format(schema: Any, param: str = "response_format") -> OutputFormat:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise GrammarError(f"the JSON schema is not valid JSON: {exc}", param) from None
    if not isinstance(schema, (dict, bool)):
        raise GrammarError(f"a JSON schema must be an object, got {type(schema).__name__}", param)
    return OutputFormat("json_schema", json.dumps(schema, separators=(",", ":")), param)


def structural_tag_format(spec: dict[str, Any], param: str = "tools") -> OutputFormat:
    """Free text in which each `begin` trigger opens a constrained section (tool_choice=auto): spec = {"triggers":
    [...], "tags": [{"begin", "schema", "end"}, ...]}, optionally "stop_after_first": true. Kept as xgrammar's
    structural tag (its "triggered_tags" format, JSON)."""
    tags = [{"type": "tag", "begin": t["begin"], "content": {"type": "json_schema", "json_schema": t["schema"]},
             "end": t["end"]} for t in spec["tags"]]
    return OutputFormat("structural_tag", json.dumps({"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": spec["triggers"], "tags": tags,
        "stop_after_first": bool(spec.get("stop_after_first", False))}}, separators=(",", ":")), param)


@dataclass(frozen=True)
class CompiledFormat:
    """An OutputFormat compiled for one tokenizer: immutable and shared, it makes a fresh constraint per sequence."""

    compiled: Any  # xgrammar.CompiledGrammar
    vocab_size: int
    stop_token_ids: tuple[int, ...]
    closing: ClosingVocab | None = None  # what may finish an output cut by its budget (closing.py)

    def constraint(self, budget: int | None = None):
        """A fresh TokenConstraint; with budget (max_new_tokens) its last tokens finish the output."""
        from .constraint import TokenConstraint

        return TokenConstraint(self.compiled, self.vocab_size, self.stop_token_ids, budget, self.closing)


@dataclass
class CompileStats:
    hits: int = 0
    misses: int = 0
    compile_ms: list[float] = field(default_factory=list)  # each first-use compile, in order (last 1000)


class GrammarCompiler:
    """Compiles OutputFormats against one tokenizer into a bounded LRU. Thread-safe."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Sequence[int], capacity: int = 256):
        try:
            import xgrammar as xgr
        except ImportError:
            from ..install_source import pip_install_extra

            raise StructuredOutputUnavailableError(
                "structured output (response_format, regex, grammar, tool calls) needs the grammar library: "
                f"{pip_install_extra('structured')}") from None
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.capacity = capacity
        self.stats = CompileStats()
        # Once per engine, at the first format (or server start-up).
        self._info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                        stop_token_ids=self.stop_token_ids or None)
        self.closing = closing_vocab(tokenizer, vocab_size)
        # Our own LRU is the cache (bounded, observable); xgrammar's internal one would be unbounded.
        self._compiler = xgr.GrammarCompiler(self._info, max_threads=1, cache_enabled=False)
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, fmt: OutputFormat):
        """The compiled grammar for fmt (cached); GrammarError when the library rejects it."""
        with self._lock:
            compiled = self._cache.get(fmt.key)
            if compiled is not None:
                self._cache.move_to_end(fmt.key)
                self.stats.hits += 1
                return compiled
        t0 = time.perf_counter()
        compiled = self._compile(fmt)
        ms = (time.perf_counter() - t0) * 1e3
        with self._lock:
            self.stats.misses += 1
            self.stats.compile_ms = (self.stats.compile_ms + [ms])[-1000:]
            self._cache[fmt.key] = compiled
            while len(self._cache) > self.capacity:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, fmt: OutputFormat):
        c = self._compiler
        compile_source = {
            # json_object: an object (xgrammar's builtin allows any value) with any keys (strict_mode off).
            "json_object": lambda _: c.compile_json_schema('{"type": "object"}', strict_mode=False,
                                                           max_whitespace_cnt=MAX_JSON_WHITESPACE),
            "json_schema": lambda source: c.compile_json_schema(source, max_whitespace_cnt=MAX_JSON_WHITESPACE),
            "regex": c.compile_regex, "grammar": c.compile_grammar, "structural_tag": c.compile_structural_tag,
        }.get(fmt.kind)
        if compile_source is None:
            raise InvalidRequestError(f"unknown output format kind {fmt.kind!r}; expected one of {FORMAT_KINDS}",
                                      fmt.param)
        try:
            return compile_source(fmt.source)
        except Exception as exc:  # xgrammar raises RuntimeError / ValueError / its own types with the reason
            what = {"json_schema": "JSON schema", "regex": "regex", "grammar": "grammar"}.get(fmt.kind, fmt.kind)
            reason = str(exc).strip().splitlines()
            raise GrammarError(f"the {what} cannot be compiled: {reason[-1] if reason else type(exc).__name__}",
                               fmt.param) from None

    def prepare(self, fmt: OutputFormat) -> CompiledFormat:
        """fmt compiled (cached) as a CompiledFormat, which makes one TokenConstraint per sequence."""
        return CompiledFormat(self.compile(fmt), self.vocab_size, tuple(self.stop_token_ids), self.closing)
