"""Live token counts, written while a job runs: the engine's running counters, the rows a running shard adds to
the store every few seconds (store/ticks.py), and a worker's current rates for its Redis record. No MLX.

The engine counts what it prefilled and generated as each step ends (worker/results.py's TokenCounters); the
shard runner reads those counters between steps and writes the difference (TickWriter), and the worker's
heartbeat thread reads them for its record (RateMeter).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from omlx_jobs import defaults

log = logging.getLogger(__name__)

TICK_SECONDS = defaults.LIVE_TICK_SECONDS
ROWS_PER_AGE = 100
"""A row is extended until it spans 1/ROWS_PER_AGE of the job's age (at least TICK_SECONDS): a long job keeps
about ROWS_PER_AGE * ln(duration / (ROWS_PER_AGE * TICK_SECONDS)) rows per worker, not one per tick."""
RATE_WINDOW_SECONDS = 20.0
"""A worker's current rates are over its last this many seconds."""


class Counters(Protocol):
    """An engine's running counters (worker/results.py's TokenCounters)."""

    def snapshot(self) -> tuple[int, int, int]:
        """(tokens prefilled, tokens generated, requests in flight now)."""
        ...


class _TickSink(Protocol):
    def add_tick(
        self, job_id: str, worker: str, started_at: float, ended_at: float, prompt: int, completion: int, in_flight: int
    ) -> int: ...

    def extend_tick(self, tick_id: int, ended_at: float, prompt: int, completion: int, in_flight: int) -> None: ...


class TickWriter:
    """A running shard's live counts into the store: every TICK_SECONDS, what the engine prefilled and
    generated since the last tick, added to this worker's open row for the job (see ROWS_PER_AGE).

    A failed write is logged and retried with the next tick (the counts carry over): live figures are advisory,
    and the results' own commits say whether the store is healthy.
    """

    def __init__(
        self,
        store: _TickSink,
        counters: Counters | None,
        job_id: str,
        worker: str,
        job_created_at: float,
        clock: Callable[[], float] = time.time,
        every: float = TICK_SECONDS,
    ) -> None:
        self.store, self.counters, self.job_id, self.worker = store, counters, job_id, worker
        self.created_at, self.clock, self.every = job_created_at, clock, every
        self._seen = counters.snapshot()[:2] if counters is not None else (0, 0)
        self._since = self._last = clock()
        self._row: int | None = None
        self._row_start = self._since

    def maybe_tick(self) -> None:
        """Write a tick if TICK_SECONDS have passed since the last one."""
        if self.counters is not None and self.clock() - self._last >= self.every:
            self.tick()

    def tick(self, *, ended: bool = False) -> None:
        """Write what was counted since the last tick (nothing when nothing was); `ended`: the shard is over,
        so none of its requests are in flight any more."""
        if self.counters is None:
            return
        now = self.clock()
        prefilled, generated, in_flight = self.counters.snapshot()
        prompt, completion = prefilled - self._seen[0], generated - self._seen[1]
        self._last = now
        try:
            self._write(now, prompt, completion, 0 if ended else in_flight)
        except Exception as exc:
            log.warning("could not write the live token counts of %s: %s", self.job_id, exc)
            return
        self._seen, self._since = (prefilled, generated), now

    def _write(self, now: float, prompt: int, completion: int, in_flight: int) -> None:
        width = max(self.every, (now - self.created_at) / ROWS_PER_AGE)
        if self._row is not None and now - self._row_start < width:
            self.store.extend_tick(self._row, now, prompt, completion, in_flight)
        elif prompt or completion or in_flight or self._row is not None:
            self._row = self.store.add_tick(self.job_id, self.worker, self._since, now, prompt, completion, in_flight)
            self._row_start = self._since

    def close(self) -> None:
        """The shard ended: write the rest, with nothing in flight."""
        self.tick(ended=True)


@dataclass
class Rates:
    """A worker's current figures, for its Redis record (jobs/workers.py)."""

    prompt_tokens_per_second: float = 0.0
    generated_tokens_per_second: float = 0.0
    in_flight: int = 0
    prefilled_tokens: int = 0
    generated_tokens: int = 0


class RateMeter:
    """A worker's current tokens per second from samples of its engine's counters (its heartbeats)."""

    def __init__(self, window: float = RATE_WINDOW_SECONDS, clock: Callable[[], float] = time.monotonic) -> None:
        self.window, self.clock = window, clock
        self._samples: collections.deque[tuple[float, int, int]] = collections.deque()
        self._lock = threading.Lock()  # the heartbeat thread and the main thread both publish

    def sample(self, counters: Counters | None, busy: bool = True) -> Rates:
        """Record the counters now; the rates over the window (zero with no engine counters)."""
        if counters is None:
            return Rates()
        prefilled, generated, in_flight = counters.snapshot()
        now = self.clock()
        with self._lock:
            self._samples.append((now, prefilled, generated))
            while len(self._samples) > 2 and self._samples[1][0] <= now - self.window:
                self._samples.popleft()
            t0, p0, g0 = self._samples[0]
        span = now - t0
        prompt = (prefilled - p0) / span if span > 0 else 0.0
        gen = (generated - g0) / span if span > 0 else 0.0
        return Rates(round(prompt, 2), round(gen, 2), in_flight if busy else 0, prefilled, generated)


def counters_of(engine: Any) -> Counters | None:
    """The engine's live counters, or None for an engine without them (the serial vision engine)."""
    counters = getattr(engine, "live", None)
    return counters if callable(getattr(counters, "snapshot", None)) else None
