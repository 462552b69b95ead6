"""What the worker says at INFO: a line when a shard starts and when it ends, a line a minute while busy, and
what a stop handed back. `omlx-jobs worker` shows this logger at INFO by default (-q hides it, -v adds the rest).

The figures come from the engine's live counters (jobs/live.py) and its prefix cache's statistics; the wording
is pure functions over them, tested without a worker.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from omlx_jobs.jobs.live import Counters, Rates, counters_of

log = logging.getLogger(__name__)

BUSY_LINE_SECONDS = 60.0
"""A busy worker says what it is doing this often."""


def hit_rate(hits: int, misses: int) -> str:
    """A prefix-cache hit rate as a line shows it: "75%", or "-" before any lookup."""
    lookups = hits + misses
    return f"{hits / lookups:.0%}" if lookups else "-"


def shard_range(start: int, end: int | None) -> str:
    return f"[{start}:{end}]" if end is not None and end >= 0 else "[all]"


def started_line(job_id: str, start: int, end: int | None) -> str:
    size = f", {end - start} requests" if end is not None and end >= 0 else ""
    return f"shard {job_id}{shard_range(start, end)} started{size}"


def finished_line(outcome: Any, generated: int | None, seconds: float) -> str:
    """The line for a shard's end: what it completed, failed, cancelled and left, its tokens and tokens per second.

    `outcome` is a worker/runtime/shard.ShardOutcome; `generated` the tokens generated while it ran (None when
    the engine keeps no live counters).
    """
    stats = outcome.stats
    parts = [f"{outcome.completed} completed", f"{outcome.failed} failed"]
    if outcome.cancelled:
        parts.append(f"{outcome.cancelled} cancelled")
    tokens = stats.generation_tokens if generated is None else generated
    rate = tokens / seconds if seconds > 0 else 0.0
    parts.append(
        f"{tokens:,} tokens generated, {stats.prefill_tokens:,} prefilled in {seconds:.1f}s ({rate:.1f} tok/s)"
    )
    parts.append(f"cache hit rate {hit_rate(stats.cache_hits, stats.cache_misses)}")
    verb = "stopped" if outcome.stopped else "finished"  # a stopped shard's next line says what went back
    return f"shard {outcome.job_id}{shard_range(outcome.start, outcome.end)} {verb}: " + ", ".join(parts)


def busy_line(job: str | None, rates: Rates, hits: int, misses: int) -> str:
    """The minute line: the shard running, requests in flight, current tokens per second, the cache's hit rate
    over the last minute."""
    return (
        f"busy on {job or '-'}: {rates.in_flight} in flight, {rates.generated_tokens_per_second:.1f} tok/s generated, "
        f"{rates.prompt_tokens_per_second:.1f} tok/s prefilled, cache hit rate {hit_rate(hits, misses)}"
    )


def stop_line(reason: str, handed_back: int, shards: int, requests: int) -> str:
    back = f"{handed_back} request(s) went back to the queue" if handed_back else "nothing went back to the queue"
    return f"worker exiting ({reason}): {shards} shard(s), {requests} request(s) done; {back}"


class ShardTalk:
    """One shard's start and end lines (the RQ entry point makes one per shard)."""

    def __init__(
        self, engine: Any, job_id: str, start: int, end: int | None, clock: Callable[[], float] = time.monotonic
    ):
        self.counters: Counters | None = counters_of(engine)
        self.clock = clock
        self._t0 = clock()
        self._generated0 = self.counters.snapshot()[1] if self.counters is not None else 0
        log.info(started_line(job_id, start, end))

    def finished(self, outcome: Any) -> None:
        generated = self.counters.snapshot()[1] - self._generated0 if self.counters is not None else None
        log.info(finished_line(outcome, generated, self.clock() - self._t0))

    def handed_back(self, requests: int, message_id: str) -> None:
        log.info("%s request(s) went back to the queue as %s", requests, message_id)


@dataclass
class BusyTalk:
    """The line a minute while busy. `maybe(...)` is called with every heartbeat; it speaks when a minute passed
    since the last line (or since the worker became busy) and the worker is still busy."""

    every: float = BUSY_LINE_SECONDS
    clock: Callable[[], float] = time.monotonic
    _since: float | None = None
    _cache: tuple[int, int] = (0, 0)

    def idle(self) -> None:
        """The shard ended: the next one starts its own minute."""
        self._since = None

    def maybe(self, job: str | None, rates: Rates, cache_stats: Any) -> str | None:
        """The line if one is due now (and logs it), else None."""
        now = self.clock()
        hits, misses = int(getattr(cache_stats, "hits", 0)), int(getattr(cache_stats, "misses", 0))
        if job is None:
            self.idle()
            return None
        if self._since is None:  # just became busy: a minute from now
            self._since, self._cache = now, (hits, misses)
            return None
        if now - self._since < self.every:
            return None
        line = busy_line(job, rates, hits - self._cache[0], misses - self._cache[1])
        self._since, self._cache = now, (hits, misses)
        log.info(line)
        return line
