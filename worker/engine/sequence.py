"""A request's way through the engine. Pure: no MLX.

WorkItem (what to run: a prompt, n choices) -> SequenceState (one choice while it generates) -> Choice ->
ItemResult, once all n choices have finished. `Collector` keeps an item only from its first admission until its
result is handed out, so memory follows the batch, not the shard.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from omlx_jobs.errors import FinishReason
from omlx_jobs.jobs.formats import SamplingParams
from omlx_jobs.jobs.params import OutputParams
from omlx_jobs.worker.engine.results import Choice, ItemResult, RequestFailure
from omlx_jobs.worker.engine.stopping import StopStrings
from omlx_jobs.worker.prompts import Prompt


@dataclass
class WorkItem:
    """One request to run: the caller's key (the store's request id), its prompt and its parameters."""

    key: Any
    tokens: list[int]
    params: SamplingParams
    prompt: Prompt = None  # type: ignore[assignment]
    """Built from `tokens` unless given (an image prompt brings its own key)."""
    output: OutputParams = field(default_factory=OutputParams)
    """What it asks for beyond sampling: response_format, logit_bias, logprobs, echo (worker/extras/outputs.py)."""
    chat: Any = None
    """A chat request's reasoning and tool-call plan (worker/reasoning/plan.py's ChatPlan), if it has one."""

    def __post_init__(self) -> None:
        if self.prompt is None:
            self.prompt = Prompt.from_tokens(self.tokens)


@dataclass
class SequenceState:
    """One choice of one item while it generates."""

    item: int
    choice: int
    stops: StopStrings | None = None
    tokens: list[int] = field(default_factory=list)
    generated: int = 0
    extra: Any = None
    """Its worker.outputs.ChoiceOutputs when the request asks for a format, a bias or logprobs."""
    chat: Any = None
    """Its item's ChatPlan (worker/reasoning/plan.py): the message is made from the text at the end."""

    def consume(self, tokens: Sequence[int], finish: str | None) -> str | None:
        """Take one step's tokens (the backend's finish reason for them); returns why the sequence ended, if it did.

        finish STOP means the last token ends the sequence (an EOS token: counted, not kept); a stop string
        ends it with STOP too, at the token that completes it, and later tokens of the step are dropped.
        """
        if len(tokens) == 1 and self.stops is None:  # the common case, once per row and step: kept short
            self.generated += 1
            if finish != FinishReason.STOP:
                self.tokens.append(tokens[0])
            return finish
        last = len(tokens) - 1
        for i, token in enumerate(tokens):
            self.generated += 1
            if i == last and finish == FinishReason.STOP:
                return FinishReason.STOP
            self.tokens.append(token)
            if self.stops is not None and self.stops.hit(token):
                return FinishReason.STOP
        return finish


@dataclass
class _Live:
    work: WorkItem
    remaining: int
    started_at: float
    cached: int
    choices: dict[int, Choice] = field(default_factory=dict)


class Collector:
    """Items in flight: from their first admitted choice until their result is taken, then forgotten."""

    def __init__(self) -> None:
        self._live: dict[int, _Live] = {}
        self._ready: list[ItemResult] = []
        self.peak = 0

    def __contains__(self, item: int) -> bool:
        return item in self._live

    def __len__(self) -> int:
        return len(self._live)

    def start(self, item: int, work: WorkItem, cached: int) -> None:
        """A choice of `item` is admitted with `cached` prompt tokens reused; an item counts its least-cached choice."""
        live = self._live.get(item)
        if live is None:
            self._live[item] = _Live(work, work.params.n, time.time(), cached)
            self.peak = max(self.peak, len(self._live))
        else:
            live.cached = min(live.cached, cached)

    def finish(self, item: int, choice: int, result: Choice) -> None:
        """A choice ended; once all of the item's have, its result is ready and the item is dropped."""
        live = self._live[item]
        live.choices[choice] = result
        live.remaining -= 1
        if live.remaining == 0:
            del self._live[item]
            self._ready.append(self._result(live, [live.choices[c] for c in range(live.work.params.n)]))

    def fail(self, item: int, failure: RequestFailure) -> None:
        """The item fails alone: its result is the failure. Its rows still in the batch are the caller's to remove
        first (a later finish of one of its choices raises KeyError)."""
        live = self._live.pop(item)
        self._ready.append(self._result(live, [], failure))

    def take(self) -> list[ItemResult]:
        """The results ready since the last call."""
        if not self._ready:
            return []
        ready, self._ready = self._ready, []
        return ready

    def unfinished(self) -> dict[int, WorkItem]:
        """Items started and not finished, by item index."""
        return {i: live.work for i, live in self._live.items()}

    @staticmethod
    def _result(live: _Live, choices: list[Choice], failure: RequestFailure | None = None) -> ItemResult:
        return ItemResult(
            key=live.work.key,
            choices=choices,
            prompt_tokens=len(live.work.prompt),
            cached_tokens=live.cached,
            started_at=live.started_at,
            finished_at=time.time(),
            error=failure,
        )
