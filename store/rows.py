"""The rows the store accepts from workers, typed: a wrong or missing field fails when the row is built."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class CompletionRow:
    """A completed request. Every field but `id` and `started_at` is a column of `requests` of the same name."""

    id: int
    output_text: str
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    more_choices: list[dict[str, Any]] | None = None
    """Choices after the first, for n > 1: [{"text": ..., "finish_reason": ...}, ...]."""
    logprobs: dict[str, Any] | None = None
    """Only when the request asked for logprobs or echo: the stored form of worker/logprobs.py."""
    chat_extras: list[dict[str, Any] | None] | None = None
    """Per choice (None for one without): its reasoning_content, tool_calls and reasoning_tokens (issue 24)."""
    vectors: bytes | None = None
    """Only for an embeddings request: its vectors in store/vectors.py's form."""
    started_at: float | None = None
    """When the request first started; kept if the row already has one."""


RESULT_COLUMNS = tuple(f.name for f in fields(CompletionRow) if f.name not in ("id", "started_at"))
"""The `requests` columns a completion writes; output lines read them back (jobs/output.py)."""
