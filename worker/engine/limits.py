"""The limits every engine checks a request against: the model's context length, and max_tokens within it; and the
tokenizer's own warning about long prompts, silenced because these checks fail such a prompt cleanly."""

from __future__ import annotations

import logging
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


TOKENIZER_LOGGER = "transformers.tokenization_utils_base"
LENGTH_WARNING = "Token indices sequence length is longer than"


class _NoLengthWarning(logging.Filter):
    """Drops transformers' "Token indices sequence length is longer than the specified maximum" warning: a prompt
    over the context fails as context_length_exceeded (check_context), so the warning only adds noise."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(LENGTH_WARNING)


NO_LENGTH_WARNING = _NoLengthWarning()


def silence_tokenizer_length_warning() -> None:
    """Install the filter on the tokenizer's logger (idempotent: a logger holds a filter once)."""
    logging.getLogger(TOKENIZER_LOGGER).addFilter(NO_LENGTH_WARNING)


def max_new_tokens(n_prompt: int, params: SamplingParams, context_length: int) -> int:
    """Tokens a request may generate: its max_tokens, cut to what the context leaves (at least one)."""
    return max(1, min(params.max_tokens, context_length - n_prompt))
