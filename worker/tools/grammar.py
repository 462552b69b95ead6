"""The grammar of a constrained tool call: the family's call markup around each allowed function's parameters
schema, as llguidance's Lark text. Pure: string building (llguidance compiles it in worker/extras/grammar.py).

Arguments are JSON under the same options as response_format (compact, every keyword enforced). A marker that
is one token of the vocabulary (`<tool_call>`, `[TOOL_CALLS]`) is written as that token (`<[id]>`), as the
template renders it; `parallel` allows up to MAX_CALLS calls, else exactly one. With `required` false (a strict tool
under tool_choice auto) the model may instead answer in text that does not start a call.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from omlx_jobs.jobs.response_format import JSON_OPTIONS
from omlx_jobs.worker.tools.families import ToolFamily

# (open, close, separator between calls, the key of the arguments): as each family's template renders a call.
MARKUP: dict[ToolFamily, tuple[str, str, str, str]] = {
    ToolFamily.HERMES: ("<tool_call>\n", "\n</tool_call>", "\n", "arguments"),
    ToolFamily.LLAMA3: ("", "", "; ", "parameters"),
    ToolFamily.MISTRAL: ("[TOOL_CALLS][", "]", ", ", "arguments"),
}


MAX_CALLS = 4
"""Calls one constrained answer may hold with parallel_tool_calls: a random or looping model must come to an end."""


def _literal(text: str) -> str:
    return json.dumps(text)


def _marker(text: str, ids: dict[str, int]) -> str:
    """`text` as grammar items: each single-token marker in it as that token (llguidance never spells an added
    token from other bytes), the rest as literals."""
    items, at = [], 0
    while at < len(text):
        hits = [(text.find(m, at), m) for m in ids if text.find(m, at) >= 0]
        if not hits:
            items.append(_literal(text[at:]))
            break
        where, marker = min(hits)
        if where > at:
            items.append(_literal(text[at:where]))
        items.append(f"<[{ids[marker]}]>")
        at = where + len(marker)
    return " ".join(items)


@dataclass(frozen=True)
class ToolGrammar:
    """A compiled-grammar key and its Lark text (GrammarCache compiles it once per key)."""

    text: str

    @property
    def key(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()[:32]

    def grammar(self) -> str:
        return self.text


def call_grammar(
    family: ToolFamily,
    functions: Sequence[dict[str, Any]],
    *,
    parallel: bool,
    required: bool,
    marker_ids: dict[str, int],
) -> ToolGrammar:
    """The grammar of a call (or calls) to one of `functions` in `family`'s markup. KeyError: no grammar for it."""
    opening, closing, sep, key = MARKUP[family]
    rules = []
    names = []
    for i, fn in enumerate(functions):
        head = _literal(f'{{"name": {json.dumps(fn["name"])}, "{key}": ')
        schema = {**(fn.get("parameters") or {"type": "object"}), "x-guidance": JSON_OPTIONS}
        rules.append(f'fn{i}: {head} args{i} "}}"')
        rules.append(f"args{i}: %json {json.dumps(schema, ensure_ascii=False)}")
        names.append(f"fn{i}")
    one = " | ".join(names)
    if family is ToolFamily.MISTRAL:  # one marker, then a JSON list of calls
        calls = f"({one})" + (f" ({_literal(sep)} ({one}))*" if parallel else "")
        body = f"{_marker(opening, marker_ids)} {calls} {_literal(closing)}"
    else:
        call = f"{_marker(opening, marker_ids)} ({one}) {_marker(closing, marker_ids)}".strip()
        rules.append(f"call: {call}")
        body = "call" + (f" ({_literal(sep)} call){{0,{MAX_CALLS - 1}}}" if parallel else "")
    start = body if required else f"({body}) | ANSWER"
    lines = [f"start: {start}", *rules]
    if not required:
        lines.append(r"ANSWER: /[^<\[{](?s:.)*/")
    return ToolGrammar("%llguidance {}\n" + "\n".join(lines) + "\n")
