"""What the grammar compiler accepts in a JSON schema but cannot enforce exactly. Pure logic, no llguidance.

- Numbers beyond +-2^53 in bounds, `const` or `enum`: llguidance reads them as 64-bit floats, so a bound of
  9007199254740993 is enforced as ...992 and 1e20 becomes 2^63-1; the output would break the schema.
- `minProperties` over keys that are not required: the grammar counts members, and a key outside `properties`
  may repeat (`{"a":1,"a":2}` is one distinct key), so an output can hold fewer distinct keys than asked.

Each check returns (code, path inside the schema, message) like response_format.check_schema, or None.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from omlx_jobs.errors import ErrorCode

EXACT_LIMIT = 2**53
"""The largest magnitude up to which every integer is a 64-bit float: bounds beyond it are not exact."""
NUMBER_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
# Where a schema keeps its subschemas: one, a list of them, or a map of names to them.
_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames", "additionalItems")
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")

Problem = tuple[str, str, str]


def subschemas(node: Any, path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """(path, schema) of `node` and every schema inside it, parents first; values of const/enum are not schemas."""
    if not isinstance(node, dict):
        return
    yield path, node
    for key in _ONE:
        if isinstance(node.get(key), dict):
            yield from subschemas(node[key], f"{path}.{key}")
    for key in _LIST:
        if isinstance(node.get(key), list):
            for i, item in enumerate(node[key]):
                yield from subschemas(item, f"{path}.{key}[{i}]")
    for key in _MAP:
        if isinstance(node.get(key), dict):
            for name, sub in node[key].items():
                yield from subschemas(sub, f"{path}.{key}.{name}")


def inexact_number(schema: Any) -> Problem | None:
    """The first bound, const or enum holding a number beyond +-2^53, which the grammar cannot enforce exactly."""
    for path, node in subschemas(schema):
        for key in NUMBER_KEYWORDS:
            if _too_big(node.get(key)):
                return _inexact(f"{path}.{key}", f"{key} {node[key]!r} is")
        for key in ("const", "enum"):
            if key in node and any(_too_big(v) for v in _numbers(node[key])):
                return _inexact(f"{path}.{key}", f"{key} holds a number")
    return None


def repeatable_keys(schema: Any) -> Problem | None:
    """The first minProperties that keys outside `required` must make up, where such keys may repeat."""
    for path, node in subschemas(schema):
        wanted = node.get("minProperties")
        if not isinstance(wanted, int) or isinstance(wanted, bool):
            continue
        required = node.get("required")
        fixed = len(set(required)) if isinstance(required, list) else 0
        extra = node.get("additionalProperties", True) is not False or bool(node.get("patternProperties"))
        if extra and wanted - fixed >= 2:  # one extra key cannot repeat a required one; two can repeat each other
            return (
                ErrorCode.UNSUPPORTED_SCHEMA,
                f"{path}.minProperties",
                f"asks for {wanted} properties, {wanted - fixed} of them beyond the required ones; the grammar "
                "counts members, and such keys may repeat (a parser keeps the last), so an output could have "
                "fewer distinct keys. Declare the keys in properties and list them in required, or drop "
                "minProperties (maxProperties alone is enforced)",
            )
    return None


def optional_beside_counts(schema: Any) -> str | None:
    """The path of the first min/maxProperties beside declared properties that are not all required while more
    keys are allowed: llguidance refuses that combination (its message names no place)."""
    for path, node in subschemas(schema):
        keys = [k for k in ("minProperties", "maxProperties") if k in node]
        declared = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        required = set(node.get("required") or []) if isinstance(node.get("required"), list) else set()
        extra = node.get("additionalProperties", True) is not False or bool(node.get("patternProperties"))
        if keys and extra and set(declared) - required:
            return f"{path}.{keys[0]}"
    return None


def _numbers(value: Any) -> Iterator[Any]:
    if isinstance(value, dict):
        for v in value.values():
            yield from _numbers(v)
    elif isinstance(value, list):
        for v in value:
            yield from _numbers(v)
    else:
        yield value


def _too_big(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) > EXACT_LIMIT


def _inexact(path: str, what: str) -> Problem:
    return (
        ErrorCode.UNSUPPORTED_SCHEMA,
        path,
        f"{what} beyond +-2^53 (9007199254740992), which constrained decoding cannot enforce exactly (the grammar "
        "compiler reads numbers as 64-bit floats); keep numbers within +-2^53, or use a string with a pattern",
    )
