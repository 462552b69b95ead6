"""Fields that OpenAI clients write which change nothing here: accepted at their no-op values. Pure logic.

Files written by OpenAI SDKs and other tools carry fields such as `user`, `metadata` or `store: false`. Each
is accepted where it has no effect on what we generate, and dropped from the stored body. A value that asks
for something we cannot do (`store: true`, `functions`, a service tier, audio) is a line error that says so: it is
never silently ignored. null is the default everywhere, as in the OpenAI API, and is always accepted.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from omlx_jobs.errors import ErrorCode
from omlx_jobs.jobs.errors import BadValue, check_text, describe, shown

MAX_METADATA_PAIRS = 16


def _string(name: str, value: Any) -> None:
    if not isinstance(value, str):
        raise BadValue(ErrorCode.INVALID_TYPE, name, f"must be a string, got {describe(value)}")
    check_text(value, name)


def _metadata(name: str, value: Any) -> None:
    if not isinstance(value, dict):
        raise BadValue(ErrorCode.INVALID_TYPE, name, f"must be an object of string values, got {describe(value)}")
    if len(value) > MAX_METADATA_PAIRS:
        raise BadValue(
            ErrorCode.OUT_OF_RANGE, name, f"holds {len(value)} pairs; at most {MAX_METADATA_PAIRS} are allowed"
        )
    for k, v in value.items():
        if not isinstance(v, str):
            raise BadValue(ErrorCode.INVALID_TYPE, f"{name}.{k}", f"metadata values must be strings, got {describe(v)}")


def _object(name: str, value: Any) -> None:
    if not isinstance(value, dict):
        raise BadValue(ErrorCode.INVALID_TYPE, name, f"must be an object, got {describe(value)}")


def _only(*allowed: Any, why: str) -> Callable[[str, Any], None]:
    """A field accepted only at the values that change nothing; `why` says what the others would need."""

    def check(name: str, value: Any) -> None:
        if not any(value == a and type(value) is type(a) for a in allowed):
            accepted = " or ".join(shown(a) for a in allowed)
            raise BadValue(
                ErrorCode.UNSUPPORTED_PARAMETER,
                name,
                f"{shown(value)} is not supported: {why}; remove it or use {accepted}",
            )

    return check


def _unsupported(why: str) -> Callable[[str, Any], None]:
    def check(name: str, value: Any) -> None:
        raise BadValue(ErrorCode.UNSUPPORTED_PARAMETER, name, f"{why}; remove it or set it to null")

    return check


def _bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise BadValue(ErrorCode.INVALID_TYPE, name, f"must be true or false, got {describe(value)}")


_NO_TOOLS = "the deprecated functions fields are not supported; give tools and tool_choice instead"
_CACHE_HINT = _object  # prompt caching is automatic here; a hint about it changes no output

# Both endpoints.
COMMON: dict[str, Callable[[str, Any], None]] = {
    "user": _string,
    "stream_options": _unsupported("stream_options only applies with stream: true, and a batch does not stream"),
}

CHAT: dict[str, Callable[[str, Any], None]] = {
    **COMMON,
    "safety_identifier": _string,
    "prompt_cache_key": _string,
    "prompt_cache_retention": _string,
    "prompt_cache_options": _CACHE_HINT,
    "metadata": _metadata,
    "store": _only(False, why="results are kept in the job's output only, not stored for distillation or evals"),
    "service_tier": _only("auto", "default", why="every request runs at the same tier here"),
    # The deprecated function-calling fields; tools, tool_choice and parallel_tool_calls are params.py's.
    "functions": _only([], why=_NO_TOOLS),
    "function_call": _only("none", "auto", why=_NO_TOOLS),
    "modalities": _only(["text"], why="only text output is generated"),
    "audio": _unsupported("audio output is not supported"),
    "prediction": _unsupported("predicted outputs are not supported"),
    "web_search_options": _unsupported("web search is not available"),
    "verbosity": _only("medium", why="output length follows max_tokens and the prompt here"),
    "moderation": _unsupported("moderation is not available"),
}

COMPLETIONS: dict[str, Callable[[str, Any], None]] = {
    **COMMON,
    "suffix": _only("", why="text insertion (a suffix after the completion) is not supported"),
    "best_of": _only(1, why="best_of is not supported; ask for n choices and pick among them"),
}
