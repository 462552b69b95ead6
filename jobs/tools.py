"""Tool calls on chat lines: `tools`, `tool_choice`, `parallel_tool_calls`, and the tool messages of a history
(an assistant message with `tool_calls`, a `tool` message with its result). Validation and the normalized form
the worker reads back from the stored body. Pure logic.

A function's `parameters` is a JSON schema checked as response_format's are (the same grammar compiler), since a
constrained call (`tool_choice` "required" or named, or `strict: true`) is decoded under a grammar of it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from omlx_jobs.errors import ErrorCode
from omlx_jobs.jobs.errors import BadValue, check_text, describe, shown
from omlx_jobs.jobs.response_format import check_schema

MAX_TOOLS = 128
NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
CHOICES = ("none", "auto", "required")
FUNCTION_KEYS = ("name", "description", "parameters", "strict")
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def _function(value: Any, name: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise BadValue(
            ErrorCode.INVALID_TYPE, name, f"must be an object with name and parameters, got {describe(value)}"
        )
    extra = sorted(set(value) - set(FUNCTION_KEYS))
    if extra:
        raise BadValue(ErrorCode.UNKNOWN_FIELD, f"{name}.{extra[0]}", f"a function takes {', '.join(FUNCTION_KEYS)}")
    fname = value.get("name")
    if not isinstance(fname, str) or not NAME.match(fname):
        raise BadValue(
            ErrorCode.INVALID_VALUE,
            f"{name}.name",
            f"must be 1-64 letters, digits, '_', '.' or '-', got {shown(fname)}",
        )
    out: dict[str, Any] = {"name": fname}
    if value.get("description") is not None:
        if not isinstance(value["description"], str):
            raise BadValue(ErrorCode.INVALID_TYPE, f"{name}.description", "must be a string")
        out["description"] = check_text(value["description"], f"{name}.description")
    params = value.get("parameters")
    if params is None:
        params = EMPTY_PARAMETERS
    if not isinstance(params, dict):
        raise BadValue(
            ErrorCode.INVALID_TYPE, f"{name}.parameters", f"must be a JSON schema object, got {describe(params)}"
        )
    problem = check_schema(json.dumps(params, ensure_ascii=False, separators=(",", ":")))
    if problem is not None:
        code, path, message = problem
        raise BadValue(code, f"{name}.parameters{path}", message)
    out["parameters"] = params
    strict = value.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise BadValue(ErrorCode.INVALID_TYPE, f"{name}.strict", f"must be true or false, got {describe(strict)}")
    if strict:
        out["strict"] = True
    return out


def validate_tools(name: str, value: Any) -> list[dict[str, Any]] | None:
    """The normalized tools list ([{"type": "function", "function": {...}}]), or None for an empty one."""
    if not isinstance(value, list):
        raise BadValue(ErrorCode.INVALID_TYPE, name, f"must be a list of tools, got {describe(value)}")
    if len(value) > MAX_TOOLS:
        raise BadValue(ErrorCode.OUT_OF_RANGE, name, f"holds {len(value)} tools; at most {MAX_TOOLS} are allowed")
    out, seen = [], set()
    for i, tool in enumerate(value):
        here = f"{name}[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise BadValue(
                ErrorCode.UNSUPPORTED_PARAMETER,
                f"{here}.type",
                f'only "function" tools are supported, got {shown(kind)}',
            )
        extra = sorted(set(tool) - {"type", "function"})
        if extra:
            raise BadValue(ErrorCode.UNKNOWN_FIELD, f"{here}.{extra[0]}", "a tool takes type and function")
        fn = _function(tool.get("function"), f"{here}.function")
        if fn["name"] in seen:
            raise BadValue(
                ErrorCode.INVALID_VALUE, f"{here}.function.name", f"{fn['name']!r} is given twice; rename one"
            )
        seen.add(fn["name"])
        out.append({"type": "function", "function": fn})
    return out or None


def validate_tool_choice(name: str, value: Any) -> str | dict[str, Any]:
    """ "none", "auto", "required", or {"type": "function", "function": {"name": ...}}."""
    if isinstance(value, str):
        if value not in CHOICES:
            raise BadValue(ErrorCode.INVALID_VALUE, name, f"must be one of {', '.join(CHOICES)} or a named function")
        return value
    fn = value.get("function") if isinstance(value, dict) else None
    if not isinstance(value, dict) or value.get("type") != "function" or not isinstance(fn, dict):
        raise BadValue(
            ErrorCode.INVALID_VALUE,
            name,
            f'must be one of {", ".join(CHOICES)} or {{"type": "function", "function": {{"name": ...}}}}',
        )
    if not isinstance(fn.get("name"), str):
        raise BadValue(ErrorCode.INVALID_TYPE, f"{name}.function.name", "must be the name of one of the tools")
    return {"type": "function", "function": {"name": fn["name"]}}


def validate_parallel(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise BadValue(ErrorCode.INVALID_TYPE, name, f"must be true or false, got {describe(value)}")
    return value


def cross_check(out: dict[str, Any], where: str) -> None:
    """Checks between tool fields and the rest of a normalized body (raises BadValue)."""
    tools, choice = out.get("tools"), out.get("tool_choice")
    if tools and out.get("response_format"):
        raise BadValue(
            ErrorCode.CONFLICTING_FIELDS,
            f"{where}response_format",
            "tools and response_format cannot be enforced together yet; give one of them",
        )
    if choice not in (None, "none", "auto") and not tools:
        raise BadValue(
            ErrorCode.CONFLICTING_FIELDS, f"{where}tool_choice", f"{shown(choice)} needs a non-empty tools list"
        )
    if isinstance(choice, dict):
        names = [t["function"]["name"] for t in tools or ()]
        wanted = choice["function"]["name"]
        if wanted not in names:
            raise BadValue(
                ErrorCode.INVALID_VALUE,
                f"{where}tool_choice.function.name",
                f"{wanted!r} is not among the tools: {names}",
            )
    if choice == "auto" or (choice == "none" and not tools):
        del out["tool_choice"]  # the default (auto with tools, none without)
    if out.get("parallel_tool_calls") is True:
        del out["parallel_tool_calls"]  # the default


def tool_message(msg: dict[str, Any], here: str) -> dict[str, Any]:
    """A history message's tool fields: an assistant's `tool_calls`, a tool message's `tool_call_id`."""
    role = msg["role"]
    out: dict[str, Any] = {}
    if role == "tool":
        cid = msg.get("tool_call_id")
        if not isinstance(cid, str) or not cid:
            message = "a tool message needs the id of the call it answers"
            raise BadValue(ErrorCode.MISSING_FIELD, f"{here}.tool_call_id", message)
        out["tool_call_id"] = cid
    calls = msg.get("tool_calls")
    if calls is not None:
        if role != "assistant":
            raise BadValue(ErrorCode.INVALID_VALUE, f"{here}.tool_calls", "only assistant messages carry tool_calls")
        if not isinstance(calls, list):
            raise BadValue(ErrorCode.INVALID_TYPE, f"{here}.tool_calls", f"must be a list, got {describe(calls)}")
        out["tool_calls"] = [_history_call(c, f"{here}.tool_calls[{i}]") for i, c in enumerate(calls)]
    return out


def _history_call(call: Any, here: str) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise BadValue(
            ErrorCode.INVALID_VALUE, here, 'must be {"id", "type": "function", "function": {"name", "arguments"}}'
        )
    args = fn.get("arguments", "{}")
    if not isinstance(args, str):
        raise BadValue(
            ErrorCode.INVALID_TYPE, f"{here}.function.arguments", "must be a JSON string, as OpenAI writes it"
        )
    try:
        json.loads(args)
    except ValueError:
        raise BadValue(ErrorCode.INVALID_VALUE, f"{here}.function.arguments", "is not valid JSON") from None
    out = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


@dataclass(frozen=True)
class ToolRequest:
    """What the worker needs of a request's tools, from its normalized body."""

    tools: tuple[dict[str, Any], ...]
    choice: str | None
    """None (auto), "required", or a function's name (named)."""
    parallel: bool

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> ToolRequest | None:
        """None when the request asks for no tool calls (no tools, or tool_choice "none")."""
        tools = body.get("tools")
        choice = body.get("tool_choice")
        if not tools or choice == "none":
            return None
        named = choice["function"]["name"] if isinstance(choice, dict) else None
        return cls(tuple(tools), named or choice, body.get("parallel_tool_calls", True))

    @property
    def constrained(self) -> bool:
        """Decoded under a grammar: a call is required, named, or a tool is strict."""
        return self.choice is not None or any(t["function"].get("strict") for t in self.tools)

    @property
    def functions(self) -> list[dict[str, Any]]:
        """The functions a constrained call may name (the named one only, when one is named)."""
        fns = [t["function"] for t in self.tools]
        if self.choice not in (None, "required"):
            fns = [f for f in fns if f["name"] == self.choice]
        return fns

    @property
    def required(self) -> bool:
        """A call must be made (required or named); with strict tools under auto, the model may also answer."""
        return self.choice is not None
