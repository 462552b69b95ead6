"""Reasoning on chat lines: `reasoning_effort`, `chat_template_kwargs` and `thinking_token_budget`: validation and
what the worker reads back from the stored body. Pure logic.

The budget takes vLLM's name, `thinking_token_budget`, so that files written for vLLM run here unchanged; the
issue's working name `max_reasoning_tokens` is refused with a hint to it (one name, not two spellings).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omlx_jobs.errors import ErrorCode
from omlx_jobs.jobs.errors import BadValue, describe, shown

EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")  # the openai client's values
THINKING_OFF = ("none", "minimal")
MAX_BUDGET = 131072
MAX_TEMPLATE_KWARGS = 16
# Keys the engine sets itself: a request cannot override them through chat_template_kwargs.
RESERVED_KWARGS = ("messages", "tools", "add_generation_prompt", "continue_final_message", "tokenize")


def validate_effort(name: str, value: Any) -> str:
    if value not in EFFORTS:
        raise BadValue(ErrorCode.INVALID_VALUE, name, f"must be one of {', '.join(EFFORTS)}, got {shown(value)}")
    return str(value)


def validate_budget(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise BadValue(
            ErrorCode.INVALID_TYPE, name, f"must be an integer number of thinking tokens, got {describe(value)}"
        )
    if not 0 <= value <= MAX_BUDGET:
        raise BadValue(ErrorCode.OUT_OF_RANGE, name, f"must be between 0 and {MAX_BUDGET}, got {value}")
    return value


def validate_template_kwargs(name: str, value: Any) -> dict[str, Any] | None:
    """An object of template variables; which ones the template uses is checked by the worker, which has it."""
    if not isinstance(value, dict):
        raise BadValue(ErrorCode.INVALID_TYPE, name, f"must be an object of template variables, got {describe(value)}")
    if len(value) > MAX_TEMPLATE_KWARGS:
        raise BadValue(
            ErrorCode.OUT_OF_RANGE, name, f"holds {len(value)} keys; at most {MAX_TEMPLATE_KWARGS} are allowed"
        )
    for key in value:
        if key in RESERVED_KWARGS or not key.isidentifier():
            raise BadValue(ErrorCode.INVALID_VALUE, f"{name}.{key}", "is not a template variable a request may set")
    return dict(value) or None


@dataclass(frozen=True)
class ReasoningRequest:
    """What the worker needs of a request's reasoning fields."""

    thinking: bool | None = None
    """False: turn thinking off (reasoning_effort none/minimal, or enable_thinking false); None: the template's."""
    budget: int | None = None
    template_kwargs: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> ReasoningRequest:
        kwargs = dict(body.get("chat_template_kwargs") or {})
        thinking = kwargs.get("enable_thinking")
        if body.get("reasoning_effort") in THINKING_OFF:
            thinking = False
        return cls(
            thinking=None if thinking is None else bool(thinking),
            budget=body.get("thinking_token_budget"),
            template_kwargs=tuple(sorted(kwargs.items())),
        )
