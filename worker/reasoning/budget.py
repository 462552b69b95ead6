"""The thinking budget: one tracker per choice that follows its thinking token by token, and the logits processor
that forces the close sequence once the budget is spent.

Forcing is exact: while a forced token is due, every other logit is -inf, so any sampler (greedy, temperature,
top-p) draws that token and nothing else; the forced tokens are generated tokens, counted as such. The tracker
also tells a grammar that must apply to the answer only (a constrained tool call, response_format after the
thinking) when the answer starts (extras/chat.py's AfterThinking).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from enum import Enum

import mlx.core as mx

from omlx_jobs.worker.reasoning.markers import ThinkMarkers


class Phase(str, Enum):
    MAYBE = "maybe"
    """At the first token of a template that thinks but has not opened the block: `<think>` may come."""
    THINKING = "thinking"
    ANSWER = "answer"


class ThinkTracker:
    """One choice's thinking, fed each generated token in order (pure: no MLX).

    `budget`: the model's own thinking tokens allowed after the open marker (None: no limit); when they are spent,
    the close sequence is queued. `tail`: after a natural close, force the rest of the close sequence too (a
    grammar of the answer then starts where it would after a forced close).
    """

    def __init__(
        self, markers: ThinkMarkers, *, opened: bool, budget: int | None, tail: bool = False, thinks: bool = True
    ) -> None:
        self.markers, self.budget, self.tail = markers, budget, tail
        self.phase = Phase.THINKING if opened else Phase.MAYBE if thinks else Phase.ANSWER
        self.fed = 0
        self.thought = 0
        """The model's own thinking tokens so far (the markers and forced tokens are not among them)."""
        self.forced = 0
        self.answer_from: int | None = 0 if self.phase is Phase.ANSWER else None
        """Index (among generated tokens) of the answer's first token, once known."""
        self._queue: deque[int] = deque()
        self._check_budget()

    def next_forced(self) -> int | None:
        """The token the next step must produce, or None if it samples freely."""
        return self._queue[0] if self._queue else None

    def feed(self, token: int) -> None:
        """The choice generated `token`."""
        self.fed += 1
        if self._queue:
            self._queue.popleft()  # forcing is exact: this is the forced token
            self.forced += 1
            if not self._queue:
                self._start_answer()
            return
        if self.phase is Phase.MAYBE:
            if token == self.markers.open_id:
                self.phase = Phase.THINKING
                self._check_budget()
            else:
                self.phase, self.answer_from = Phase.ANSWER, self.fed - 1
            return
        if self.phase is Phase.THINKING:
            if token == self.markers.close_id:
                self._queue.extend(self.markers.tail if self.tail else ())
                if not self._queue:
                    self._start_answer()
                return
            self.thought += 1
            self._check_budget()

    @property
    def in_answer(self) -> bool:
        return self.phase is Phase.ANSWER

    def _check_budget(self) -> None:
        spent = self.budget is not None and self.thought >= self.budget
        if self.phase is Phase.THINKING and spent and not self._queue:
            self._queue.extend(self.markers.close_sequence)

    def _start_answer(self) -> None:
        self.phase, self.answer_from = Phase.ANSWER, self.fed


class ForceThinking:
    """A BatchGenerator logits processor over a ThinkTracker: it feeds the tracker each generated token and, while
    a forced token is due, leaves only that token's logit finite. `no_end_while_thinking` (the EOS ids) keeps a
    choice whose answer a grammar must give from ending inside its thinking.

    The first call sees the prompt; each later call sees one more generated token (its last).
    """

    def __init__(self, tracker: ThinkTracker, no_end_while_thinking: Sequence[int] = ()) -> None:
        self.tracker = tracker
        self._calls = 0
        self._ends = mx.array(list(no_end_while_thinking), dtype=mx.int32) if no_end_while_thinking else None

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if self._calls:
            self.tracker.feed(int(tokens[-1].item()))
        self._calls += 1
        forced = self.tracker.next_forced()
        if forced is None:
            if self._ends is not None and self.tracker.phase is Phase.THINKING:
                return logits.at[:, self._ends].add(mx.array(-mx.inf, dtype=logits.dtype))
            return logits
        only = mx.arange(logits.shape[-1]) == forced
        return mx.where(only, mx.zeros_like(logits), mx.array(-mx.inf, dtype=logits.dtype))
