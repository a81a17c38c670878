"""Output formats: parsing, compiling (cached, typed errors), per-sequence constraints (mask, accepts, rollback)."""
from __future__ import annotations

import json

import pytest
import torch

from kvboost import InvalidRequestError
from kvboost.decoding.grammar import GrammarCompiler, GrammarError, OutputFormat, parse_output_format

pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green"]},
                                           "n": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["color", "n"]}


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id], capacity=3)


def test_parse_formats():
    assert parse_output_format() is None
    assert parse_output_format({"type": "text"}) is None
    assert parse_output_format({"type": "json_object"}).kind == "json_object"
    fmt = parse_output_format({"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}})
    assert fmt.kind == "json_schema" and json.loads(fmt.source) == SCHEMA
    assert parse_output_format({"type": "json_schema", "json_schema": SCHEMA}).source == fmt.source  # bare schema
    assert parse_output_format(regex="a+").kind == "regex"
    assert parse_output_format(grammar='root ::= "x"').kind == "grammar"


@pytest.mark.parametrize("kwargs, param", [
    (dict(response_format={"type": "xml"}), "response_format.type"),
    (dict(response_format="json"), "response_format"),
    (dict(response_format={"type": "json_schema"}), "response_format.json_schema"),
    (dict(response_format={"type": "json_object"}, regex="a"), "regex"),
    (dict(regex=""), "regex"),
])
def test_bad_formats_are_typed_errors(kwargs, param):
    with pytest.raises(InvalidRequestError) as info:
        parse_output_format(**kwargs)
    assert info.value.param == param


def test_uncompilable_inputs_name_the_problem(compiler):
    for fmt in (OutputFormat("json_schema", '{"type": "object", "properties": {"a": {"$ref": "#/nope"}}}'),
                OutputFormat("regex", "a(b", "regex"), OutputFormat("grammar", "root ::= undefined_rule", "grammar")):
        with pytest.raises(GrammarError) as info:
            compiler.compile(fmt)
        assert info.value.param == fmt.param and "cannot be compiled" in str(info.value)


def test_compiled_grammars_are_cached_and_bounded(compiler):
    fmts = [OutputFormat("regex", f"a{{{i}}}", "regex") for i in range(1, 5)]
    first = compiler.compile(fmts[0])
    hits = compiler.stats.hits
    assert compiler.compile(fmts[0]) is first and compiler.stats.hits == hits + 1
    for f in fmts:
        compiler.compile(f)
    misses = compiler.stats.misses
    compiler.compile(fmts[-1])
    assert compiler.stats.misses == misses  # the 3 (capacity) most recent stay cached
    compiler.compile(fmts[0])
    assert compiler.stats.misses == misses + 1  # the oldest was evicted


def test_constraint_walks_a_schema_and_allows_eos_only_at_the_end(compiler, tokenizer):
    c = compiler.prepare(OutputFormat("json_schema", json.dumps(SCHEMA))).constraint()
    eos = tokenizer.eos_token_id
    text = '{"color": "green", "n": 7}'
    for t in tokenizer.encode(text, add_special_tokens=False):
        assert not c.accepts(eos)
        allowed = torch.isfinite(c.mask(torch.zeros(len(tokenizer))))
        assert allowed[t] and allowed.sum() < len(allowed) and c.accepts(t)
        c.advance(t)
    assert c.accepts(eos)
    masked = c.mask(torch.zeros(len(tokenizer)))
    assert torch.isfinite(masked).nonzero().flatten().tolist() == [eos]
    c.rollback(1)  # the "}" again: only it is allowed after the number
    assert not c.accepts(eos)
    c.advance(tokenizer.encode("}", add_special_tokens=False)[0])
    c.advance(eos)
    assert c.finished


def test_mask_leaves_padded_vocab_out(tokenizer):
    compiler = GrammarCompiler(tokenizer, len(tokenizer) + 64, [tokenizer.eos_token_id])
    c = compiler.prepare(OutputFormat("regex", "[0-9]+", "regex")).constraint()
    masked = c.mask(torch.zeros(len(tokenizer) + 64))
    assert torch.isinf(masked[len(tokenizer):]).all() and torch.isfinite(masked).any()
