"""The limits every engine checks a request against: the model's context length, and max_tokens within it."""

from __future__ import annotations

from collections.abc import Sequence

from omlx_jobs.errors import ErrorCode
from omlx_jobs.jobs.formats import SamplingParams
from omlx_jobs.worker.prompts import PromptError


def check_context(tokens: Sequence[int], context_length: int) -> None:
    """PromptError if the prompt leaves no room to generate within the model's context."""
    if len(tokens) >= context_length:
        raise PromptError(
            ErrorCode.CONTEXT_LENGTH_EXCEEDED,
            f"the prompt is {len(tokens)} tokens; this model's context is {context_length} tokens. Shorten the prompt",
        )


def max_new_tokens(n_prompt: int, params: SamplingParams, context_length: int) -> int:
    """Tokens a request may generate: its max_tokens, cut to what the context leaves (at least one)."""
    return max(1, min(params.max_tokens, context_length - n_prompt))
