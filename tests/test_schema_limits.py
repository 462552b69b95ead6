"""What a json_schema may ask that the grammar cannot enforce (issue 21: 3, 11, 18, 19): the pure checks, and
llguidance itself showing why each refusal is needed (a grammar that would let a wrong output through)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import llguidance
import pytest

from omlx_jobs.jobs.response_format import JSON_OPTIONS, _first_mask_error, check_schema
from omlx_jobs.jobs.schema_limits import inexact_number, repeatable_keys, subschemas
from omlx_jobs.jobs.schema_satisfiable import resolve_ref, unsatisfiable

SCHEMAS = json.loads((Path(__file__).parent / "data/schemas/schemas.json").read_text())["schemas"]


def _grammar(schema: Any) -> str:
    return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=JSON_OPTIONS)


def _accepts(schema: Any, text: str) -> bool:
    """Whether the compiled grammar lets `text` through as a complete output (a byte-level vocabulary)."""
    from omlx_jobs.jobs.response_format import _byte_tokenizer

    matcher = llguidance.LLMatcher(_byte_tokenizer(), _grammar(schema), log_level=0)
    return bool(matcher.consume_tokens(list(text.encode()))) and bool(matcher.is_accepting())


def test_subschemas_walks_schemas_only() -> None:
    schema = {
        "properties": {"a": {"minimum": 1}},
        "const": {"minimum": 1e30},  # a value, not a schema
        "anyOf": [{"type": "string"}],
        "$defs": {"d": {"items": {"type": "integer"}}},
    }
    assert [p for p, _ in subschemas(schema)] == ["", ".anyOf[0]", ".properties.a", ".$defs.d", ".$defs.d.items"]


@pytest.mark.parametrize(
    ("schema", "path"),
    [
        ({"type": "integer", "maximum": 2**53 + 1}, ".maximum"),
        ({"type": "number", "exclusiveMinimum": -1e300}, ".exclusiveMinimum"),
        ({"type": "integer", "multipleOf": 1e20}, ".multipleOf"),
        ({"properties": {"n": {"const": {"x": [1, 2**60]}}}}, ".properties.n.const"),
        ({"items": {"enum": ["a", -(2**54)]}}, ".items.enum"),
    ],
)
def test_numbers_beyond_2_53_are_named(schema: dict[str, Any], path: str) -> None:
    problem = inexact_number(schema)
    assert problem is not None and problem[:2] == ("unsupported_schema", path)


def test_numbers_within_2_53_pass() -> None:
    assert inexact_number({"type": "integer", "minimum": -(2**53), "maximum": 2**53, "enum": [0.5, 2**53]}) is None
    assert inexact_number({"type": "boolean", "exclusiveMaximum": True}) is None  # draft-4 booleans are not bounds


def test_the_grammar_rounds_bounds_beyond_2_53() -> None:
    """Why they are refused: the compiled grammar refuses the one value the schema allows."""
    schema = {"type": "integer", "minimum": 2**53 + 1, "maximum": 2**53 + 1}
    assert not _accepts(schema, str(2**53 + 1))
    assert _accepts({"type": "integer", "minimum": 2**53, "maximum": 2**53}, str(2**53))


def test_min_properties_over_repeatable_keys() -> None:
    refused = {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 3}
    assert repeatable_keys(refused) is not None
    # Why: the grammar takes three members that are one distinct key.
    assert _accepts(refused, '{"a":1,"a":2,"a":3}')
    # One key beyond the required ones cannot repeat them (the grammar keeps required names out of the extras).
    one_extra = {"type": "object", "required": ["a", "b"], "minProperties": 3}
    assert repeatable_keys(one_extra) is None
    assert not _accepts(one_extra, '{"a":1,"b":2,"a":3}')
    assert repeatable_keys({"type": "object", "required": ["a"], "minProperties": 3}) is not None
    assert repeatable_keys({"type": "object", "additionalProperties": False, "minProperties": 3}) is None
    assert repeatable_keys({"type": "object", "patternProperties": {"^x": {}}, "maxProperties": 3}) is None


@pytest.mark.parametrize(
    ("schema", "path"),
    [
        ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, ".$defs.b.$ref"),
        ({"type": "object", "properties": {"n": {"$ref": "#"}}, "required": ["n"]}, ".properties.n.$ref"),
        (
            {"$defs": {"l": {"type": "array", "items": {"$ref": "#/$defs/l"}, "minItems": 1}}, "$ref": "#/$defs/l"},
            ".$defs.l.items.$ref",
        ),
        (
            {
                "$defs": {
                    "a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}}, "required": ["b"]},
                    "b": {"allOf": [{"$ref": "#/$defs/a"}]},
                },
                "type": "object",
                "properties": {"x": {"$ref": "#/$defs/a"}},
                "required": ["x"],
            },
            ".$defs.b.allOf[0].$ref",
        ),
    ],
)
def test_recursion_without_an_end_is_found(schema: dict[str, Any], path: str) -> None:
    found = unsatisfiable(schema)
    assert found is not None and found[0] == path and "can never be satisfied" in found[1]


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "properties": {"n": {"$ref": "#"}}},  # optional
        {"type": ["object", "null"], "properties": {"n": {"$ref": "#"}}, "required": ["n"]},  # null ends it
        {
            "$defs": {"t": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"$ref": "#/$defs/t"}}]}},
            "$ref": "#/$defs/t",
        },
        {"properties": {"n": {"$ref": "#"}}, "required": ["n"]},  # no type: a string matches
        {"type": "object", "properties": {"n": {"$ref": "#/$defs/missing"}}, "required": ["n"]},  # the compiler's
    ],
)
def test_recursion_that_can_end_passes(schema: dict[str, Any]) -> None:
    assert unsatisfiable(schema) is None


def test_every_example_schema_is_satisfiable_and_accepted() -> None:
    for case in SCHEMAS:
        assert unsatisfiable(case["schema"]) is None, case["name"]
        assert check_schema(json.dumps(case["schema"])) is None, case["name"]


def test_resolve_ref_reads_json_pointers() -> None:
    root = {"$defs": {"a/b": {"x": 1}, "t~": [{"y": 2}]}}
    assert resolve_ref(root, "#") is root
    assert resolve_ref(root, "#/$defs/a~1b") == {"x": 1}
    assert resolve_ref(root, "#/$defs/t~0/0") == {"y": 2}
    assert resolve_ref(root, "#/$defs/none") is None
    assert resolve_ref(root, "https://example.org/s.json") is None


def test_a_ref_cycle_fails_the_first_mask_as_the_worker_would() -> None:
    grammar = _grammar({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"})
    assert _first_mask_error(grammar) is not None
    assert _first_mask_error(_grammar({"type": "object"})) is None


def test_one_of_is_named_at_the_branchy_keyword() -> None:
    schema = {
        "type": "object",
        "properties": {
            "kind": {"oneOf": [{"type": "null"}, {"type": "string"}]},  # provably exclusive: fine
            "shape": {"type": "object", "oneOf": [{"required": ["a"]}, {"required": ["b"]}]},
        },
    }
    problem = check_schema(json.dumps(schema))
    assert problem is not None and problem[:2] == ("unsupported_schema", ".properties.shape.oneOf")
    assert "anyOf" in problem[2]
    assert check_schema(json.dumps({"oneOf": [{"type": "null"}, {"type": "string"}]})) is None


def test_counts_beside_optional_properties_are_named() -> None:
    schema = {"type": "object", "properties": {"p": {"type": "object", "properties": {"a": {}}, "maxProperties": 2}}}
    problem = check_schema(json.dumps(schema))
    assert problem is not None and problem[:2] == ("unsupported_schema", ".properties.p.maxProperties")


def test_contradictions_say_they_can_never_be_satisfied() -> None:
    problem = check_schema(json.dumps({"type": "integer", "minimum": 5, "maximum": 3}))
    assert problem is not None and problem[0] == "invalid_schema" and problem[2].startswith("can never be satisfied")
