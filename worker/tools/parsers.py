"""Tool calls read out of an output, one parser per family. Pure: no MLX.

A parser returns the text outside the calls and the calls it read: each call names one of the request's functions
and its arguments are a JSON object. Markup that does not parse (broken JSON, an unknown function, a call cut by
max_tokens) stays in the text: a call is never dropped, only not recognised.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from omlx_jobs.worker.tools.families import ToolFamily


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str
    """A JSON object, as text (OpenAI's function.arguments)."""


@dataclass(frozen=True)
class Parsed:
    content: str
    calls: list[Call]


def _call(obj: Any, names: set[str], key: str = "arguments") -> Call | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get(key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return Call(obj["name"], json.dumps(args, ensure_ascii=False))


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_hermes(text: str, functions: Sequence[dict[str, Any]]) -> Parsed:
    names = {f["name"] for f in functions}
    calls, kept, at = [], [], 0
    for m in _HERMES.finditer(text):
        call = _call(_loads(m.group(1)), names)
        if call is None:
            continue
        kept.append(text[at : m.start()])
        at = m.end()
        calls.append(call)
    kept.append(text[at:])
    return Parsed("".join(kept).strip(), calls)


_CODER_CALL = re.compile(r"<tool_call>\s*<function=([^>\s]+)>(.*?)</function>\s*</tool_call>", re.DOTALL)
_CODER_PARAM = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


def _typed(value: str, schema: Any) -> Any:
    """A Qwen3-Coder parameter's text as its schema's type: strings as written, anything else as JSON."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind == "string":
        return value
    parsed = _loads(value)
    return value if parsed is None and kind is None else parsed


def parse_qwen3_coder(text: str, functions: Sequence[dict[str, Any]]) -> Parsed:
    by_name = {f["name"]: f for f in functions}
    calls, kept, at = [], [], 0
    for m in _CODER_CALL.finditer(text):
        fn = by_name.get(m.group(1))
        if fn is None:
            continue
        props = (fn.get("parameters") or {}).get("properties") or {}
        args = {p.group(1): _typed(p.group(2), props.get(p.group(1))) for p in _CODER_PARAM.finditer(m.group(2))}
        if any(v is None for v in args.values()):  # a typed value that is not JSON: not a call
            continue
        kept.append(text[at : m.start()])
        at = m.end()
        calls.append(Call(fn["name"], json.dumps(args, ensure_ascii=False)))
    kept.append(text[at:])
    return Parsed("".join(kept).strip(), calls)


def _json_sequence(text: str, sep: str) -> list[Any] | None:
    """JSON values one after another, separated by `sep` (and whitespace); None unless the whole text is that."""
    decoder, values, at = json.JSONDecoder(), [], 0
    while True:
        while at < len(text) and (text[at].isspace() or text[at] == sep):
            at += 1
        if at == len(text):
            return values
        try:
            value, at = decoder.raw_decode(text, at)
        except ValueError:
            return None
        values.append(value)


def parse_llama3(text: str, functions: Sequence[dict[str, Any]]) -> Parsed:
    names = {f["name"] for f in functions}
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return Parsed(text.strip(), [])
    values = _json_sequence(body, ";")
    calls = [_call(v, names, key="parameters") for v in values or ()]
    if not values or any(c is None for c in calls):
        return Parsed(text.strip(), [])
    return Parsed("", [c for c in calls if c is not None])


_MISTRAL_ARGS = re.compile(r"([A-Za-z0-9_.-]+)\[ARGS\]")


def parse_mistral(text: str, functions: Sequence[dict[str, Any]]) -> Parsed:
    names = {f["name"] for f in functions}
    before, marker, rest = text.partition("[TOOL_CALLS]")
    if not marker:
        return Parsed(text.strip(), [])
    rest = rest.strip()
    if rest.startswith("["):
        values = _json_sequence(rest, ",")
        items = values[0] if values and len(values) == 1 and isinstance(values[0], list) else None
        calls = [_call(v, names) for v in items or ()]
    else:  # the newer form: name[ARGS]{...}name[ARGS]{...}
        calls = _mistral_named(rest, names)
        items = calls
    if not items or any(c is None for c in calls):
        return Parsed(text.strip(), [])
    return Parsed(before.strip(), [c for c in calls if c is not None])


def _mistral_named(rest: str, names: set[str]) -> list[Call | None]:
    calls: list[Call | None] = []
    decoder, at = json.JSONDecoder(), 0
    while at < len(rest):
        m = _MISTRAL_ARGS.match(rest, at)
        if m is None:
            return [None]
        try:
            args, at = decoder.raw_decode(rest, m.end())
        except ValueError:
            return [None]
        calls.append(_call({"name": m.group(1), "arguments": args}, names))
        while at < len(rest) and rest[at].isspace():
            at += 1
    return calls


PARSERS: dict[ToolFamily, Callable[[str, Sequence[dict[str, Any]]], Parsed]] = {
    ToolFamily.HERMES: parse_hermes,
    ToolFamily.QWEN3_CODER: parse_qwen3_coder,
    ToolFamily.LLAMA3: parse_llama3,
    ToolFamily.MISTRAL: parse_mistral,
}


def parse_calls(family: ToolFamily, text: str, functions: Sequence[dict[str, Any]]) -> Parsed:
    """The calls in `text` as `family` writes them, and the text outside them."""
    return PARSERS[family](text, functions)
