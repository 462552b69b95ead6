"""What the engine hands back: each request's result (or its failure) and the run's accounting. Pure: no MLX.

`completion_row` is the one place where an engine result becomes a store row: a new output field is added to
Choice or ItemResult here, to store/rows.py's CompletionRow (and its column in store/models.py), and mapped here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omlx_jobs.errors import ErrorCode, FinishReason
from omlx_jobs.jobs.stored_logprobs import Entry, StoredLogprobs
from omlx_jobs.store.rows import CompletionRow


@dataclass
class Choice:
    """One of a request's n completions."""

    text: str
    finish_reason: str
    completion_tokens: int
    token_ids: list[int]
    logprobs: list[Entry] | None = None
    """Its tokens' logprobs in their stored entry form (jobs/stored_logprobs.py), when asked for."""
    prompt_logprobs: list[Entry] | None = None
    """echo with logprobs: the prompt's entries (the same for every choice)."""
    chat: dict[str, Any] | None = None
    """A chat answer's reasoning_content, tool_calls and reasoning_tokens, if any (worker/reasoning/plan.py)."""


@dataclass(frozen=True)
class RequestFailure:
    """Why one request failed on its own (its neighbours are not charged): stored as its error code and message."""

    code: ErrorCode
    message: str


@dataclass
class ItemResult:
    """A finished request: its choices in order, or the failure that ended it."""

    key: Any
    choices: list[Choice]
    prompt_tokens: int
    cached_tokens: int
    started_at: float
    finished_at: float
    error: RequestFailure | None = None
    vectors: bytes | None = None
    """An embeddings request's vectors (store/vectors.py's form): it has no choices."""

    @property
    def completion_tokens(self) -> int:
        return sum(c.completion_tokens for c in self.choices)


def completion_row(result: ItemResult) -> CompletionRow:
    """The store row of a completed request (see the module docstring)."""
    if result.error is not None or not (result.choices or result.vectors is not None):
        raise ValueError(f"request {result.key!r} did not complete; store its failure instead")
    if result.vectors is not None:
        return CompletionRow(
            id=result.key,
            output_text="",
            finish_reason=FinishReason.EMBEDDED.value,
            prompt_tokens=result.prompt_tokens,
            cached_tokens=result.cached_tokens,
            completion_tokens=0,
            vectors=result.vectors,
            started_at=result.started_at,
        )
    first, *more = result.choices
    return CompletionRow(
        id=result.key,
        output_text=first.text,
        finish_reason=first.finish_reason,
        prompt_tokens=result.prompt_tokens,
        cached_tokens=result.cached_tokens,
        completion_tokens=result.completion_tokens,
        more_choices=[{"text": c.text, "finish_reason": c.finish_reason} for c in more] or None,
        logprobs=_stored_logprobs(result.choices),
        chat_extras=[c.chat for c in result.choices] if any(c.chat for c in result.choices) else None,
        started_at=result.started_at,
    )


def _stored_logprobs(choices: list[Choice]) -> dict[str, Any] | None:
    """The logprobs column (jobs/stored_logprobs.py's form), or None when none were asked for."""
    if all(c.logprobs is None for c in choices):
        return None
    return StoredLogprobs([c.logprobs or [] for c in choices], choices[0].prompt_logprobs).to_json()


@dataclass(frozen=True)
class PlanTotals:
    """The prompt tokens of one planned page: all of them, and the distinct ones (the trie minimum)."""

    prompt_tokens: int
    trie_min_tokens: int


@dataclass
class RunStats:
    prompt_tokens: int = 0
    trie_min_tokens: int = 0
    prefill_tokens: int = 0
    """Prompt tokens actually run through the model: warm-ups plus every uncached suffix."""
    warmup_tokens: int = 0
    warmups: int = 0
    warmup_seconds: float = 0.0
    first_token_reuses: int = 0
    disk_hits: int = 0
    generation_tokens: int = 0
    prefill_seconds: float = 0.0
    """Time in the backend's prompt processing (uncached suffixes, including merging cached prefixes)."""
    decode_seconds: float = 0.0
    seconds: float = 0.0
    unfinished: list[Any] = field(default_factory=list)
    """Keys of the items read from the input that have no result (the run was stopped)."""
    input_exhausted: bool = True
    """False when the run stopped before reading all of its input (items never read are not in `unfinished`)."""
    peak_live_items: int = 0
    """Most items held at once between admission and their result: bounded by the batch, not the shard."""
    cache_hits: int = 0
    cache_misses: int = 0
    cache_evictions: int = 0
    """Prefix-cache lookups and evictions during this run (the cache itself lives across runs)."""
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    """Speculative decoding: tokens drafted and verified, and those of them accepted (docs/speculation.md)."""
    verify_steps: int = 0
    """Decode steps that verified drafts (the others decoded one token per row)."""

    @property
    def rejected_tokens(self) -> int:
        return self.drafted_tokens - self.accepted_tokens


class TokenCounters:
    """Tokens an engine prefilled and generated since it was made, and the requests in flight now: what the
    live figures count (jobs/live.py reads them between steps and from the heartbeat thread).

    The engine calls observe() once per loop iteration with its run's statistics (which start at zero each run)
    and the warm-up tokens of the run so far; the counters add the runs up. Plain ints, set by one thread.
    """

    def __init__(self) -> None:
        self.prefilled = 0
        self.generated = 0
        self.in_flight = 0
        self._run: object | None = None
        self._base = (0, 0)
        self._last = (0, 0)

    def observe(self, stats: RunStats, warmup_tokens: int, in_flight: int) -> None:
        if stats is not self._run:  # a new run: the last one's final counts become the base
            self._run = stats
            self._base = (self._base[0] + self._last[0], self._base[1] + self._last[1])
        self._last = (stats.prefill_tokens + warmup_tokens, stats.generation_tokens)
        self.prefilled = self._base[0] + self._last[0]
        self.generated = self._base[1] + self._last[1]
        self.in_flight = in_flight

    def snapshot(self) -> tuple[int, int, int]:
        """(prefilled, generated, in flight)."""
        return self.prefilled, self.generated, self.in_flight
