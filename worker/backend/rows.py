"""What the engine and a decode batch exchange: rows to start (RowSpec), what each step gives per row (RowOutput),
where a batch's time went (Timings), and the calls a batch answers (Batch). Types only: no mlx-lm in here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import mlx.core as mx

from omlx_jobs.errors import FinishReason
from omlx_jobs.worker.cache.prefix_cache import Match

Caches = list[Any]
Sampler = Callable[[mx.array], mx.array]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]
StepLogits = Callable[[mx.array, list[Any], list[int]], mx.array]
"""(the batch's logits, each row's batchable processor or None, each row's last token) -> logits: one call
per decode step for every row's batchable processor (extras/logits.py's BatchablePart: bias and grammar)."""


@dataclass
class RowSpec:
    """One row to start: what it still has to compute, what it starts from, and how it samples."""

    prompt: list[int]
    """Prompt tokens not in `prefix` (at least one; for first_tokens, none)."""
    max_tokens: int
    prefix: Match | None = None
    """The first `prefix.length` positions of a prefix-cache entry, reused (DecodeBatch copies them into the row;
    a CascadeBatch references them)."""
    context: list[int] = field(default_factory=list)
    """The tokens before `prompt` (those in `prefix`): what logits processors see first."""
    sampler: Sampler | None = None
    """None: greedy, sampled for the whole batch in one call."""
    processors: list[LogitsProcessor] = field(default_factory=list)
    """Per-request logits processors (penalties, logprob tap, grammar and logit_bias), called as proc(tokens, logits);
    one marked `batchable` is applied for the whole batch in decode steps when `step_logits` is set."""
    logits: Any = None
    """first_tokens only: the logits after the last prompt token, cached."""


@dataclass(slots=True)
class RowOutput:
    """What one step produced for one row (one is made per row and step: slots keep that cheap)."""

    row: int
    tokens: list[int]
    """New tokens in order: one per step here, several for a multi-token backend."""
    logprobs: list[mx.array]
    """Per token, the log-softmax (after logits processors) it was sampled from: a lazy vector over the vocabulary."""
    finish: FinishReason | str | None
    """STOP: the last token ends the sequence (end-of-sequence); LENGTH: max_tokens reached; None: going on."""


@dataclass(frozen=True)
class Timings:
    prefill_seconds: float = 0.0
    """In prompt processing of inserted rows (uncached suffixes, merging cached prefixes included)."""
    decode_seconds: float = 0.0


class Batch(Protocol):
    """What the engine asks of a decode batch: decode.DecodeBatch, or cascade_batch.CascadeBatch."""

    timings: Timings

    def insert(self, rows: Sequence[RowSpec]) -> list[int]: ...

    def step(self) -> list[RowOutput]: ...

    def remove(self, rows: Sequence[int]) -> None: ...

    def first_tokens(self, rows: Sequence[RowSpec]) -> list[RowOutput]: ...

    def close(self) -> Timings: ...
