"""response_format on chat lines: validation, the normalized form, and the grammar it compiles to.

Pure logic apart from llguidance (a Rust extension with no dependencies, no MLX), which checks a schema at
submit exactly as the worker compiles it, so a schema accepted here always compiles there. Checks are cached
by schema text: a file usually repeats one schema on every line.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from omlx_jobs.errors import ErrorCode
from omlx_jobs.jobs import schema_limits
from omlx_jobs.jobs.errors import BadValue, check_text, describe, shown
from omlx_jobs.jobs.schema_satisfiable import unsatisfiable

TYPES = ("text", "json_object", "json_schema")
NAME_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
# json_object: any JSON object, as OpenAI's JSON mode.
JSON_OBJECT_SCHEMA: dict[str, Any] = {"type": "object"}
# Compact JSON, no whitespace outside strings: a model cannot spend its tokens on (or loop in) whitespace.
# lenient=False: a keyword the grammar cannot enforce is an error, never skipped.
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "lenient": False}
SUPPORTED_KEYWORDS = (
    "type, properties, required, additionalProperties, items, prefixItems, minItems, maxItems, enum, const, "
    "anyOf, oneOf, allOf, $ref/$defs, minimum, maximum, exclusiveMinimum, exclusiveMaximum, multipleOf, "
    "minLength, maxLength, pattern, format, patternProperties, minProperties, maxProperties"
)
# Keywords whose value maps names to subschemas: their keys are names, not keywords.
_NAMED_SUBSCHEMAS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")


@dataclass(frozen=True)
class ResponseFormat:
    """A constrained output: `schema_json` is the schema as JSON text, in the line's key order (which the
    output follows), and `key` identifies the compiled grammar."""

    kind: str  # "json_object" or "json_schema"
    schema_json: str
    name: str | None = None

    @property
    def key(self) -> str:
        return hashlib.sha256(f"{self.kind}\n{self.schema_json}".encode()).hexdigest()[:32]

    def grammar(self) -> str:
        """The llguidance grammar text (compiled by the worker, checked at submit)."""
        import llguidance

        return llguidance.LLMatcher.grammar_from_json_schema(self.schema_json, overrides=JSON_OPTIONS)  # type: ignore[arg-type]

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> ResponseFormat | None:
        """From a normalized body (as validate_response_format stored it); None means plain text."""
        rf = body.get("response_format")
        if rf is None:
            return None
        if rf["type"] == "json_object":
            return cls("json_object", _schema_text(JSON_OBJECT_SCHEMA))
        spec = rf["json_schema"]
        return cls("json_schema", _schema_text(spec["schema"]), spec.get("name"))


def _schema_text(schema: Any) -> str:
    return json.dumps(schema, ensure_ascii=False, separators=(",", ":"))


def validate_response_format(name: str, value: Any) -> dict[str, Any] | None:
    """The normalized response_format of a chat line, or None for plain text. Raises BadValue."""
    if not isinstance(value, dict):
        raise BadValue(
            ErrorCode.INVALID_TYPE, name, f'must be an object like {{"type": "json_object"}}, got {describe(value)}'
        )
    kind = value.get("type")
    if kind is None:
        raise BadValue(ErrorCode.MISSING_FIELD, f"{name}.type", f"is missing; use one of {', '.join(TYPES)}")
    if kind not in TYPES:
        raise BadValue(ErrorCode.INVALID_VALUE, f"{name}.type", f"must be one of {', '.join(TYPES)}, got {shown(kind)}")
    allowed = {"type", "json_schema"} if kind == "json_schema" else {"type"}
    extra = sorted(set(value) - allowed)
    if extra:
        raise BadValue(
            ErrorCode.UNKNOWN_FIELD, f"{name}.{extra[0]}", f"is not a field of a {kind} response_format; remove it"
        )
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": _json_schema(value.get("json_schema"), f"{name}.json_schema")}


def _json_schema(spec: Any, name: str) -> dict[str, Any]:
    if spec is None:
        raise BadValue(ErrorCode.MISSING_FIELD, name, 'is missing; give {"name": ..., "schema": {...}}')
    if not isinstance(spec, dict):
        raise BadValue(ErrorCode.INVALID_TYPE, name, f"must be an object with name and schema, got {describe(spec)}")
    extra = sorted(set(spec) - {"name", "schema", "strict", "description"})
    if extra:
        raise BadValue(
            ErrorCode.UNKNOWN_FIELD, f"{name}.{extra[0]}", "unknown field; json_schema takes name, schema, strict"
        )
    title = spec.get("name")
    if title is None:
        raise BadValue(ErrorCode.MISSING_FIELD, f"{name}.name", 'is missing; name the schema, e.g. "person"')
    if not isinstance(title, str) or not NAME_PATTERN.match(title):
        raise BadValue(
            ErrorCode.INVALID_VALUE, f"{name}.name", f"must be 1-64 letters, digits, _ or -, got {shown(title)}"
        )
    if spec.get("description") is not None:
        if not isinstance(spec["description"], str):
            raise BadValue(
                ErrorCode.INVALID_TYPE, f"{name}.description", f"must be a string, got {describe(spec['description'])}"
            )
        check_text(spec["description"], f"{name}.description")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise BadValue(ErrorCode.INVALID_TYPE, f"{name}.strict", f"must be true or false, got {describe(strict)}")
    schema = spec.get("schema")
    if schema is None:
        raise BadValue(
            ErrorCode.MISSING_FIELD, f"{name}.schema", "is missing; give the JSON schema the output must match"
        )
    if not isinstance(schema, dict):
        raise BadValue(
            ErrorCode.INVALID_TYPE, f"{name}.schema", f"must be a JSON schema object, got {describe(schema)}"
        )
    problem = check_schema(_schema_text(schema))
    if problem is not None:
        code, path, message = problem
        raise BadValue(code, f"{name}.schema{path}", message)
    # The schema is always enforced in full, so strict: false is honoured by doing more than it asks.
    return {"name": title, "schema": schema, "strict": bool(strict)}


@functools.lru_cache(maxsize=256)
def check_schema(schema_json: str) -> tuple[str, str, str] | None:
    """None if the grammar compiler accepts the schema and can enforce it, else (code, path inside the schema,
    message). Checked before compiling: numbers the compiler reads inexactly, keys that may repeat; after:
    what it reports, recursion no finite value ends, and its first token mask."""
    import llguidance

    schema = json.loads(schema_json)
    problem = schema_limits.inexact_number(schema) or schema_limits.repeatable_keys(schema)
    if problem is not None:
        return problem
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema_json, overrides=JSON_OPTIONS)  # type: ignore[arg-type]
    except ValueError as exc:  # serde_json's nesting limit (128 levels) is raised, not reported
        return (ErrorCode.INVALID_SCHEMA, "", f"cannot be read by the grammar compiler ({exc}); nest it less deeply")
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if messages:
        return _compiler_problem(messages[0], schema, is_error)
    endless = unsatisfiable(schema)
    if endless is not None:
        return (ErrorCode.INVALID_SCHEMA, *endless)
    error = _first_mask_error(grammar)
    if error is not None:
        return (
            ErrorCode.INVALID_SCHEMA,
            "",
            f"cannot be satisfied: the grammar compiled from it allows no output ({error})",
        )
    return None


def _compiler_problem(message: str, schema: Any, is_error: bool) -> tuple[str, str, str]:
    """What llguidance's message means for the user, with the path of the keyword it is about."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    text = lines[0]
    if text.startswith("regex parse error") and len(lines) > 1:  # the pattern, a caret, then what is wrong
        return (
            ErrorCode.INVALID_SCHEMA,
            _find_keyword(schema, "pattern", lines[1]) or "",
            f"has a pattern that is not a valid regular expression: {lines[1]!r}: {lines[-1].removeprefix('error: ')}",
        )
    unimplemented = re.match(r"Unimplemented keys: \[(.*)\]", text)
    if unimplemented:
        keys = json.loads(f"[{unimplemented.group(1)}]")
        return (
            ErrorCode.UNSUPPORTED_SCHEMA,
            _find_keyword(schema, keys[0]) or "",
            f"uses {', '.join(repr(k) for k in keys)}, which constrained decoding cannot enforce; remove it or "
            f"express it with the supported keywords ({SUPPORTED_KEYWORDS})",
        )
    fmt = re.match(r"Unknown format: (.*)", text)
    if fmt:
        return (
            ErrorCode.UNSUPPORTED_SCHEMA,
            _find_keyword(schema, "format", fmt.group(1)) or "",
            f"uses format {fmt.group(1)!r}, which is not supported; use a pattern instead, or one of date, time, "
            "date-time, duration, email, hostname, ipv4, ipv6, uuid, uri",
        )
    if "retrieving it failed" in text:
        return (
            ErrorCode.UNSUPPORTED_SCHEMA,
            _find_keyword(schema, "$ref") or "",
            "refers to a schema outside itself, which is never fetched; put the definition under $defs and "
            'refer to it as "#/$defs/NAME"',
        )
    if text.startswith("oneOf constraints are not supported"):
        return (ErrorCode.UNSUPPORTED_SCHEMA, _overlapping_one_of(schema), ONE_OF_MESSAGE)
    if text.startswith("min/maxProperties only supported"):
        path = schema_limits.optional_beside_counts(schema) or _find_keyword(schema, "minProperties") or ""
        return (ErrorCode.UNSUPPORTED_SCHEMA, path, COUNTS_MESSAGE)
    if text.startswith("Unsatisfiable schema"):
        return (ErrorCode.INVALID_SCHEMA, "", f"can never be satisfied: {text.removeprefix('Unsatisfiable schema: ')}")
    if not is_error:  # a warning: something the grammar would not enforce; never skipped silently
        return (ErrorCode.UNSUPPORTED_SCHEMA, "", f"cannot be enforced as written: {text}")
    return (ErrorCode.INVALID_SCHEMA, "", f"is not a valid JSON schema: {text}")


ONE_OF_MESSAGE = (
    "uses oneOf with branches that constrained decoding cannot prove exclusive, so it cannot enforce that a value "
    "matches exactly one; use anyOf if a value may match several, or make the branches exclusive (a property "
    'with a different "const" in each, or additionalProperties: false with distinct required keys)'
)
COUNTS_MESSAGE = (
    "uses minProperties/maxProperties beside declared properties that are not all required while other keys "
    "are allowed, which constrained decoding cannot enforce; list every declared property in required, or set "
    "additionalProperties to false, or drop minProperties/maxProperties"
)
MAX_ONE_OF_PROBES = 16


def _overlapping_one_of(schema: Any) -> str:
    """The path of the oneOf that llguidance cannot prove disjoint: the first that still fails when every other
    oneOf is read as anyOf (its message names no place)."""
    import llguidance

    places = [path for path, node in schema_limits.subschemas(schema) if isinstance(node.get("oneOf"), list)]
    for path in places[:MAX_ONE_OF_PROBES]:
        probe = copy.deepcopy(schema)
        for other, node in schema_limits.subschemas(probe):
            if other != path and isinstance(node.get("oneOf"), list):
                node.setdefault("allOf", []).append({"anyOf": node.pop("oneOf")})
        grammar = llguidance.LLMatcher.grammar_from_json_schema(_schema_text(probe), overrides=JSON_OPTIONS)  # type: ignore[arg-type]
        _, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
        if messages and messages[0].startswith("oneOf constraints are not supported"):
            return f"{path}.oneOf"
    return f"{places[0]}.oneOf" if places else ""


@functools.cache
def _byte_tokenizer() -> Any:
    """A vocabulary of the 256 bytes and an end token: enough to ask a grammar for its first token mask."""
    import llguidance

    class Bytes:
        def __init__(self) -> None:
            self.eos_token_id, self.bos_token_id = 256, None
            self.tokens = [bytes([i]) for i in range(256)] + [b"</s>"]
            self.special_token_ids = [256]

        def __call__(self, text: bytes) -> list[int]:
            return list(text)

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(Bytes()))


def _first_mask_error(grammar: str) -> str | None:
    """The error a matcher of `grammar` enters when asked for its first token mask, as the worker does; or None."""
    import llguidance

    matcher = llguidance.LLMatcher(_byte_tokenizer(), grammar, log_level=0)
    if not matcher.is_error():
        matcher.compute_bitmask()
    return matcher.get_error().splitlines()[0] if matcher.is_error() else None


def _find_keyword(schema: Any, keyword: str, value: Any = None, path: str = "") -> str | None:
    """The path (".properties.a.not") of the first place `keyword` is used as a keyword, not a name."""
    for here, node in _schemas(schema, path):
        if keyword in node and (value is None or node[keyword] == value):
            return f"{here}.{keyword}"
    return None


def _schemas(node: Any, path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    if not isinstance(node, dict):
        return
    yield path, node
    for key, child in node.items():
        if key in _NAMED_SUBSCHEMAS and isinstance(child, dict):
            for sub_name, sub in child.items():
                yield from _schemas(sub, f"{path}.{key}.{sub_name}")
        elif isinstance(child, dict):
            yield from _schemas(child, f"{path}.{key}")
        elif isinstance(child, list):
            for i, item in enumerate(child):
                yield from _schemas(item, f"{path}.{key}[{i}]")
