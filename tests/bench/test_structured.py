"""The shipped structured-output set: enough schemas, each a valid JSON Schema that xgrammar compiles, and the
summary arithmetic."""
from __future__ import annotations

import pytest

from benchmarks.structured import Case, _summarize, load_cases, schema_valid


def test_shipped_set_has_20_or_more_valid_schemas_with_the_features_asked_for():
    import jsonschema

    cases = load_cases()
    assert len(cases) >= 20 and all(len(c["prompts"]) >= 2 for c in cases)
    text = " ".join(str(c["schema"]) for c in cases)
    for feature in ("'enum'", "'minimum'", "'maximum'", "'array'", "'boolean'", "'number'"):
        assert feature in text
    assert any(set(c["schema"]["properties"]) != set(c["schema"]["required"]) for c in cases)  # optional fields
    assert any(any(p.get("type") == "object" for p in c["schema"]["properties"].values()) for c in cases)  # nested
    for c in cases:
        jsonschema.Draft202012Validator.check_schema(c["schema"])


def test_every_shipped_schema_compiles(tokenizer):
    pytest.importorskip("xgrammar")
    from kvboost.decoding.grammar import GrammarCompiler, json_schema_format

    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    for c in load_cases():
        compiler.compile(json_schema_format(c["schema"]))
    assert compiler.stats.misses == len(load_cases())


def test_validity_and_summary():
    schema = {"type": "object", "properties": {"a": {"type": "integer", "maximum": 3}}, "required": ["a"]}
    assert schema_valid('{"a": 2}', schema) and not schema_valid('{"a": 5}', schema)
    assert not schema_valid("```json\n{}```", schema)
    cases = [Case("s", "p", False, True, 11, 6, 1.0, 1.0, 0.5, "stop", "{}", "x"),
             Case("s", "q", True, True, 21, 11, 2.0, 1.0, 0.5, "stop", "{}", "y"),
             Case("s", "r", False, False, 21, 11, 2.0, 1.0, 0.5, "length", "{", "y")]
    s = _summarize(cases, 1, [10.0, 30.0, 20.0], [0.01, 0.02, 0.03], 5.0)
    assert s.constrained_valid_rate == pytest.approx(2 / 3) and s.free_valid_rate == pytest.approx(1 / 3)
    assert s.constrained_ended_rate == pytest.approx(2 / 3) and s.valid_when_ended_rate == 1.0
    assert s.free_decode_tok_s == pytest.approx(50 / 5.0) and s.constrained_decode_tok_s == pytest.approx(25 / 3.0)
    assert s.compile_ms_p50 == 20.0 and s.compile_ms_max == 30.0 and s.mask_ms_per_token == pytest.approx(0.5)
