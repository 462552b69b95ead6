"""Engine failures contained to the request that caused them (issue 10, defect 4).

When the engine raises during a run, every request admitted beside the culprit is in the same batch. Rather than
fail them all, `run_contained`:
  - hands the failed attempt back (`hooks.refund`): a request is charged only for runs that did not end in an engine
    exception (a crash of the whole process still counts, as no refund runs then);
  - rebuilds the worker's MLX state, which an exception mid-graph can leave broken (mlx-lm's sampler raising
    inside mx.compile leaves the global random state as an array without a primitive: every later sample fails);
  - runs the requests that were in flight again, in halves, until each failing one runs alone; a request that
    makes the engine raise MAX_ALONE_TRIES times alone fails with `engine_error` and the message;
  - goes on with the rest of the input as before.
A request that fails alone while none succeeds is not evidence against it: after MAX_FAILING_IN_A_ROW of those,
the engine itself is taken as broken and the error is raised (the shard goes back to the queue, as before).

Exceptions of the caller's own callbacks and input (the store, a bad row) and the shard's timeout (RQ raises it
from a signal, wherever the run is) are never contained.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import mlx.core as mx
from rq.timeouts import BaseTimeoutException

from omlx_jobs.errors import ErrorCode
from omlx_jobs.worker.engine.contract import EngineLike, Hooks, ResultsHook
from omlx_jobs.worker.engine.results import ItemResult, PlanTotals, RequestFailure, RunStats
from omlx_jobs.worker.engine.sequence import WorkItem
from omlx_jobs.worker.prompts import PromptError

log = logging.getLogger(__name__)

MAX_ALONE_TRIES = 2
"""A request that makes the engine raise this many times when run alone fails with engine_error."""
MAX_FAILING_IN_A_ROW = 4
"""Requests failing alone one after another with no success between them: the engine is broken, not them."""
ENGINE_ERROR = ErrorCode.ENGINE_ERROR


class EngineBroken(RuntimeError):
    """Every request the engine tried alone failed: the fault is the worker's, not the requests'."""


def rebuild(engine: EngineLike) -> None:
    """Make the engine's MLX state usable after an exception mid-run: reseed the global random state (an
    exception inside a compiled sampler leaves it unevaluable), reset the engine (its shared samplers and
    in-memory prefix cache), and free MLX's buffer cache."""
    mx.random.seed(int.from_bytes(os.urandom(4), "little"))
    engine.reset()
    mx.clear_cache()


class _Attempt:
    """One engine run's bookkeeping: the items it read and admitted that have no result yet."""

    def __init__(self) -> None:
        self.read: dict[Any, WorkItem] = {}
        self.admitted: set[Any] = set()
        self.done: set[Any] = set()

    def feed(self, items: Iterable[WorkItem]) -> Iterator[WorkItem]:
        for work in items:
            self.read[work.key] = work
            yield work

    def finished(self, results: list[ItemResult]) -> None:
        for r in results:
            self.read.pop(r.key, None)
            self.admitted.discard(r.key)
            self.done.add(r.key)

    def split(self) -> tuple[list[WorkItem], list[WorkItem]]:
        """(admitted without a result: the suspects; read but never admitted: innocent), in input order."""
        items = list(self.read.values())
        return [w for w in items if w.key in self.admitted], [w for w in items if w.key not in self.admitted]


class _Contained:
    """The state of one contained run; see run_contained."""

    def __init__(self, engine: EngineLike, hooks: Hooks, page_size: int | None) -> None:
        self.engine, self.hooks, self.page_size = engine, hooks, page_size
        self.caller_error: BaseException | None = None
        """The last exception raised by the caller's code (callbacks, input): passed through, never contained."""
        self.total = RunStats()
        self.failing_in_a_row = 0
        self.source_done = False

    # ---- the caller's code, with its exceptions marked ---------------------------------------------------

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except BaseException as exc:
            self.caller_error = exc
            raise

    def source(self, items: Iterable[WorkItem]) -> Iterator[WorkItem]:
        it = iter(items)
        while True:
            try:
                work = next(it)
            except StopIteration:
                self.source_done = True
                return
            except BaseException as exc:
                self.caller_error = exc
                raise
            yield work

    # ---- one engine run ------------------------------------------------------------------------------------

    def attempt(self, items: Iterable[WorkItem], attempt: _Attempt, *, plan: bool) -> RunStats:
        """One engine.run over `items`, recording what it read, admitted and finished in `attempt`."""

        def on_results(results: list[ItemResult]) -> None:
            attempt.finished(results)
            if any(r.error is None for r in results):
                self.failing_in_a_row = 0
            self._call(self.hooks.results, results)

        def on_admit(keys: list[Any]) -> None:
            attempt.admitted.update(keys)
            if self.hooks.admit is not None:
                self._call(self.hooks.admit, keys)

        def on_plan(totals: PlanTotals) -> None:
            if self.hooks.plan is not None:
                self._call(self.hooks.plan, totals)

        hooks = Hooks(
            results=on_results,
            control=lambda: self._call(self.hooks.control),
            admit=on_admit,
            plan=on_plan if plan else None,
        )
        stats = self.engine.run(attempt.feed(items), hooks, page_size=self.page_size)
        _add(self.total, stats)
        return stats

    def failed(self, exc: Exception, attempt: _Attempt) -> tuple[list[WorkItem], list[WorkItem]]:
        """After an engine exception: re-raise it if it was the caller's; else refund and rebuild, and return
        the attempt's (suspects, innocent)."""
        suspects, innocent = attempt.split()
        if exc is self.caller_error or isinstance(exc, BaseTimeoutException) or not suspects:
            raise exc  # the caller's, or before any request started (a planning failure: the shard's, as before)
        log.warning(
            "the engine raised with %s requests in flight (%s: %s); running them again in isolation",
            len(suspects),
            type(exc).__name__,
            exc,
        )
        if self.hooks.refund is not None:
            self._call(self.hooks.refund, [w.key for w in suspects])
        rebuild(self.engine)
        return suspects, innocent

    def stopped(self, stats: RunStats) -> bool:
        """True if control stopped this run early (drain, stop, cancel)."""
        return bool(stats.unfinished) or not stats.input_exhausted


def run_contained(
    engine: EngineLike, items: Iterable[WorkItem], hooks: Hooks | ResultsHook, *, page_size: int | None = None
) -> RunStats:
    """Engine.run with failures contained (see the module docstring). hooks.refund gets the keys of requests whose
    attempt ended in an engine exception (hooks.admit charged them one). Returns the accounting of all the runs."""
    c = _Contained(engine, Hooks.of(hooks), page_size)
    source = c.source(items)
    carry: list[WorkItem] = []  # read by a failed run and never admitted: they run first in the next one
    while True:
        attempt = _Attempt()
        try:
            stats = c.attempt(_chain(carry, source), attempt, plan=True)
        except Exception as exc:
            suspects, carry = c.failed(exc, attempt)
            left = _isolate(c, suspects)
            if left:  # control stopped the isolation: the rest stays pending
                c.total.unfinished = [w.key for w in (*left, *carry)]
                c.total.input_exhausted = c.source_done
                return c.total
            continue
        c.total.unfinished, c.total.input_exhausted = list(stats.unfinished), stats.input_exhausted
        return c.total


def _chain(first: list[WorkItem], rest: Iterator[WorkItem]) -> Iterator[WorkItem]:
    yield from first
    yield from rest


def _isolate(c: _Contained, suspects: list[WorkItem]) -> list[WorkItem]:
    """Run `suspects` again in halves until each failing one is alone; fail those that fail alone. Returns the
    items left unrun because control stopped it ([] when all ran)."""
    groups: deque[list[WorkItem]] = deque([suspects] if suspects else [])
    alone_tries: dict[Any, int] = {}
    while groups:
        group = groups.popleft()
        attempt = _Attempt()
        try:
            stats = c.attempt(group, attempt, plan=False)
        except Exception as exc:
            c.failed(exc, attempt)
            failing = [w for w in group if w.key not in attempt.done]
            if len(failing) > 1:
                half = len(failing) // 2
                groups.extendleft([failing[half:], failing[:half]])
            elif failing:
                _failed_alone(c, failing[0], exc, alone_tries, groups)
            continue
        if c.stopped(stats):  # what it left (read or not) and the groups not run yet stay pending
            return [w for w in group if w.key not in attempt.done] + [w for g in groups for w in g]
    return []


def _failed_alone(
    c: _Contained, work: WorkItem, exc: Exception, tries: dict[Any, int], groups: deque[list[WorkItem]]
) -> None:
    """`work` made the engine raise on its own: try it again, or fail it with engine_error."""
    tries[work.key] = tries.get(work.key, 0) + 1
    if isinstance(exc, PromptError):  # the request's own input (an image the processor refused): no second try
        _fail(c, work, RequestFailure(exc.code, exc.message))
        return
    if tries[work.key] < MAX_ALONE_TRIES:
        groups.appendleft([work])
        return
    c.failing_in_a_row += 1
    if c.failing_in_a_row > MAX_FAILING_IN_A_ROW:
        # Charge what is left again, so that a shard on a broken engine cannot cycle through the queue for ever.
        if c.hooks.admit is not None:
            c._call(c.hooks.admit, [work.key, *(w.key for g in groups for w in g)])
        raise EngineBroken(
            f"{c.failing_in_a_row} requests in a row made the engine raise alone, none succeeding between: "
            f"the worker's engine is broken (last: {type(exc).__name__}: {exc})"
        ) from exc
    message = (
        f"the engine raised while running this request alone, {tries[work.key]} times: {type(exc).__name__}: {exc}"
    )
    log.error("request %r fails alone: %s", work.key, message)
    _fail(c, work, RequestFailure(ENGINE_ERROR, message))


def _fail(c: _Contained, work: WorkItem, failure: RequestFailure) -> None:
    now = time.time()
    result = ItemResult(work.key, [], len(work.prompt), 0, now, now, error=failure)
    c._call(c.hooks.results, [result])


def _add(total: RunStats, stats: RunStats) -> None:
    """Add one run's accounting to the total (peak: the larger; unfinished, input_exhausted: set by the caller)."""
    for f in dataclasses.fields(RunStats):
        if f.name in ("unfinished", "input_exhausted"):
            continue
        a, b = getattr(total, f.name), getattr(stats, f.name)
        setattr(total, f.name, max(a, b) if f.name == "peak_live_items" else a + b)
