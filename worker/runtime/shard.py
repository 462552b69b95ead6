"""Run one shard: read its pending requests from the store, generate them, commit each result at once.

Used by the RQ entry point (worker) and by `omlx-jobs run` (local, no Redis) alike.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from rq.timeouts import BaseTimeoutException

from omlx_jobs import defaults
from omlx_jobs.errors import ErrorCode
from omlx_jobs.jobs import lifecycle
from omlx_jobs.jobs.formats import SamplingParams
from omlx_jobs.jobs.live import TickWriter, counters_of
from omlx_jobs.jobs.params import OutputParams
from omlx_jobs.jobs.sharding import UNIT
from omlx_jobs.store import Store, StoreError
from omlx_jobs.store.pending import PAGE_ROWS, PendingRequest
from omlx_jobs.store.shards import ShardInfo
from omlx_jobs.worker.engine.contract import Control, EngineLike, Hooks
from omlx_jobs.worker.engine.results import ItemResult, PlanTotals, RunStats, completion_row
from omlx_jobs.worker.engine.sequence import WorkItem
from omlx_jobs.worker.prompts import PromptError, common_prefix, key_prefix
from omlx_jobs.worker.runtime.containment import run_contained

log = logging.getLogger(__name__)

MAX_ATTEMPTS = defaults.MAX_ATTEMPTS
"""A request started this many times without a result (worker crashes, engine errors) fails for good."""
STATUS_POLL_SECONDS = 1.0
MAX_SHARD_FAILURES = 3
"""A shard that failed this many times before any request started (planning, a bad row) is given up:
its pending requests fail with SHARD_FAILED instead of going back to the queue without end."""
SHARD_FAILED = ErrorCode.SHARD_FAILED


@dataclass
class ShardOutcome:
    job_id: str
    start: int
    end: int
    completed: int = 0
    failed: int = 0
    cancelled: int = 0
    left_pending: int = 0
    stopped: bool = False
    """True when a stop request (drain, shutdown) ended the run with requests still pending."""
    stats: RunStats = field(default_factory=RunStats)

    def to_dict(self) -> dict[str, int | bool | str]:
        return {
            "job_id": self.job_id,
            "start": self.start,
            "end": self.end,
            "completed": self.completed,
            "failed": self.failed,
            "cancelled": self.cancelled,
            "left_pending": self.left_pending,
            "stopped": self.stopped,
            "prefill_tokens": self.stats.prefill_tokens,
            "trie_min_tokens": self.stats.trie_min_tokens,
            "drafted_tokens": self.stats.drafted_tokens,  # speculative decoding (docs/speculation.md)
            "accepted_tokens": self.stats.accepted_tokens,
        }


class _JobWatch:
    """Polls the job's status at most once a second, so a cancel reaches a running shard quickly."""

    def __init__(self, store: Store, job_id: str, external: Callable[[], Control] | None) -> None:
        self.store, self.job_id, self.external = store, job_id, external
        self.cancelled = False
        self._next = 0.0

    def __call__(self) -> Control:
        now = time.monotonic()
        if not self.cancelled and now >= self._next:
            self._next = now + STATUS_POLL_SECONDS
            status = self.store.get_job(self.job_id).status
            # Cancelled, or ended under it (an API batch that expired): stop rather than compute unused results.
            self.cancelled = status == lifecycle.CANCELLING or status in lifecycle.TERMINAL
        if self.cancelled:
            return Control.CANCEL
        return self.external() if self.external else Control.RUN


def run_shard(
    store: Store,
    engine: EngineLike,
    job_id: str,
    start: int = 0,
    end: int | None = None,
    *,
    control: Callable[[], Control] | None = None,
    on_progress: Callable[[int], None] | None = None,
    worker: str | None = None,
    meter: Callable[[int, int], None] | None = None,
    page_rows: int = PAGE_ROWS,
) -> ShardOutcome:
    """Generate every pending request of job `job_id` with position (prefix order) in [start, end), read from the
    store `page_rows` at a time.

    `worker` names who runs it (recorded with the results, and the model it serves); `meter` gets
    (requests, completion tokens) as results are committed.
    """
    outcome = ShardOutcome(job_id, start, end if end is not None else -1)
    job = store.get_job(job_id)
    if job.status in lifecycle.TERMINAL:
        return outcome
    if job.status in (lifecycle.CANCELLING, lifecycle.CANCELLED):
        outcome.cancelled = store.cancel_pending(job_id)
        lifecycle.finalize_if_done(store, job_id)
        return outcome
    store.transition(job_id, lifecycle.IN_PROGRESS, only_from=[lifecycle.VALIDATING])
    shard_row = store.get_shard(job_id, start) if end is not None else None
    if shard_row is not None and shard_row.failures >= MAX_SHARD_FAILURES:
        outcome.failed += _give_up(store, job_id, shard_row)
        lifecycle.finalize_if_done(store, job_id)
        return outcome
    run_id = store.start_run(job_id, start, end, worker or local_worker_name(), engine.loaded.ref)
    where = (start, end, shard_row, run_id)
    run = ShardRun(store, engine, outcome, where, on_progress=on_progress, meter=meter, page_rows=page_rows)
    ticks = TickWriter(store, counters_of(engine), job_id, worker or local_worker_name(), job.created_at)
    try:
        run.run(_ticking(control, ticks))
    except Exception as exc:
        with contextlib.suppress(Exception):  # the store may be what failed: keep the original error
            store.finish_run(run_id, "failed", f"{type(exc).__name__}: {exc}")
            if shard_row is not None and not run.admitted and not isinstance(exc, StoreError):
                # Failed before any request started, so no attempt was counted: count the shard's instead.
                n = store.record_shard_failure(job_id, start, f"{type(exc).__name__}: {exc}")
                log.warning(
                    "shard %s[%s:%s] failed before starting a request (%s/%s)",
                    job_id,
                    start,
                    end,
                    n,
                    MAX_SHARD_FAILURES,
                )
        raise
    finally:
        ticks.close()
    store.finish_run(run_id, "stopped" if outcome.stopped else "done")
    lifecycle.finalize_if_done(store, job_id)
    log.info("shard %s[%s:%s]: %s", job_id, start, end, outcome.to_dict())
    return outcome


def _ticking(control: Callable[[], Control] | None, ticks: TickWriter) -> Callable[[], Control]:
    """The run's control, writing the live token counts first: the engine asks it once per step."""

    def ask() -> Control:
        ticks.maybe_tick()
        return control() if control is not None else Control.RUN

    return ask


def local_worker_name() -> str:
    """Who runs a shard outside RQ (`omlx-jobs run`): host and process."""
    return f"{socket.gethostname()}.{os.getpid()}"


def _give_up(store: Store, job_id: str, shard: ShardInfo) -> int:
    """Fail the pending requests of a shard that failed MAX_SHARD_FAILURES times before starting any."""
    message = (
        f"the shard holding this request failed {shard.failures} times before any request started "
        f"(last: {shard.last_error}); fix the cause, then `omlx-jobs retry {job_id}`"
    )
    n = store.fail_pending(job_id, shard.first_pos, SHARD_FAILED, message)
    log.error(
        "job %s: gave up on shard [%s:%s] after %s failures: %s",
        job_id,
        shard.first_pos,
        shard.end_pos,
        shard.failures,
        shard.last_error,
    )
    return n


def work_items(
    store: Store,
    engine: EngineLike,
    pending: Iterable[PendingRequest],
    outcome: ShardOutcome,
    run_id: int | None = None,
) -> Iterator[tuple[WorkItem, bytes]]:
    """The engine's work items for pending requests, tokenized, with their sort keys; a request that cannot run
    fails here, alone (too many attempts, a prompt the model cannot take)."""
    for req in pending:
        if req.attempts >= MAX_ATTEMPTS:
            store.record_failure(
                req.id,
                ErrorCode.TOO_MANY_ATTEMPTS,
                f"started {req.attempts} times without finishing (worker crashes or engine errors); "
                "run `omlx-jobs retry JOB` to try again",
                run_id=run_id,
            )
            outcome.failed += 1
            continue
        params, output = SamplingParams.from_body(req.body), OutputParams.from_body(req.body)
        tokens: list[int] = []
        try:
            prompt = engine.loaded.prompt(req.endpoint, req.body)  # images fetched and checked here
            tokens = prompt.tokens
            chat = engine.loaded.chat_plan(req.endpoint, req.body, tokens)  # reasoning and tools (issue 24)
            output = chat.constrain(output) if chat is not None else output
            engine.check(tokens, params, output)
        except PromptError as exc:
            store.record_failure(req.id, exc.code, exc.message, prompt_tokens=len(tokens) or None, run_id=run_id)
            outcome.failed += 1
            continue
        except BaseTimeoutException:
            raise  # the shard's timeout, raised by RQ wherever the run is: never one request's
        except Exception as exc:  # any other failure building one prompt is that request's alone (issue 21, 1)
            message = f"building this request's prompt failed ({type(exc).__name__}: {str(exc)[:300]})"
            log.exception("request %s: %s", req.id, message)
            store.record_failure(req.id, ErrorCode.INVALID_PROMPT, message, run_id=run_id)
            outcome.failed += 1
            continue
        yield WorkItem(req.id, tokens, params, prompt, output=output, chat=chat), req.sort_key


def _fetching_ahead(engine: EngineLike, pages: Iterable[list[PendingRequest]]) -> Iterator[list[PendingRequest]]:
    """The pages, each one's remote images fetched several at once as it is read (vision/inputs/prefetch.py)."""
    want = getattr(engine.loaded, "want_images", None)
    for page in pages:
        if want is not None:
            want([(r.endpoint, r.body) for r in page])
        yield page


def store_results(store: Store, results: list[ItemResult], run_id: int | None = None) -> tuple[int, int]:
    """Commit a step's results: completions in one transaction (completion_row maps them), then each failure.

    Returns how many of each were stored (a request that already has a final result takes no second one).
    """
    completed = store.record_completions([completion_row(r) for r in results if r.error is None], run_id=run_id)
    failed = 0
    for r in results:
        if r.error is not None:
            failed += store.record_failure(
                r.key, r.error.code, r.error.message, prompt_tokens=r.prompt_tokens, run_id=run_id
            )
    return completed, failed


class ShardRun:
    """One run of a shard: its input read a page at a time, and the hooks through which the engine's results,
    admissions and plans reach the store (what it admitted and planned so far is kept here)."""

    def __init__(
        self,
        store: Store,
        engine: EngineLike,
        outcome: ShardOutcome,
        where: tuple[int, int | None, ShardInfo | None, int],
        *,
        on_progress: Callable[[int], None] | None = None,
        meter: Callable[[int, int], None] | None = None,
        page_rows: int = PAGE_ROWS,
    ) -> None:
        self.store, self.engine, self.outcome, self.page_rows = store, engine, outcome, page_rows
        self.start, self.end, self.shard_row, self.run_id = where
        self.on_progress, self.meter = on_progress, meter
        self.admitted = False
        """A request has started (each was charged an attempt): a failure is then no longer the shard's."""
        self.trie_min_tokens = 0
        """The trie minimum of the pages planned so far."""
        self.plan_recorded = False
        # Rows are read a page at a time and tokenized as the scheduler plans them: memory follows the page.
        self.source = ShardInput()
        pages = _fetching_ahead(engine, store.pending_pages(outcome.job_id, self.start, self.end, page_rows=page_rows))
        rows = self.source.rows(pages)
        self.source.placed = work_items(store, engine, rows, outcome, self.run_id)

    def run(self, control: Callable[[], Control] | None) -> None:
        """Generate the shard's pending requests (failures contained), then settle its accounting."""
        watch = _JobWatch(self.store, self.outcome.job_id, control)
        hooks = Hooks(
            results=self.results, control=watch, admit=self.admit, plan=self.plan, refund=self.store.refund_attempts
        )
        stats = run_contained(self.engine, self.source, hooks, page_size=self.page_rows)
        if stats.input_exhausted:  # the last page was full: no plan call saw the input end
            self.record_plan()
        _settle(self.store, self.engine, self.outcome, stats, cancelled=watch.cancelled)

    def results(self, results: list[ItemResult]) -> None:
        completed, failed = store_results(self.store, results, self.run_id)
        self.outcome.completed += completed
        self.outcome.failed += failed
        if self.on_progress:
            self.on_progress(len(results))
        if self.meter:
            self.meter(len(results), sum(r.completion_tokens for r in results))

    def admit(self, keys: list[Any]) -> None:
        self.admitted = True
        self.store.mark_started(keys)

    def plan(self, totals: PlanTotals) -> None:
        self.trie_min_tokens += totals.trie_min_tokens
        if self.shard_row is None and self.source.fresh:  # a whole job in one run (`omlx-jobs run`): the job's
            self.store.add_job_stats(self.outcome.job_id, trie_min_tokens=totals.trie_min_tokens)
        elif self.source.exhausted:
            self.record_plan()

    def record_plan(self) -> None:
        """Record the shard's plan once, less what it shares with its neighbours (Store.record_shard_plan)."""
        if self.shard_row is not None and not self.plan_recorded:
            self.plan_recorded = True
            job_id, source = self.outcome.job_id, self.source
            self.store.record_shard_plan(job_id, self.start, self.trie_min_tokens, source.lead, source.tail)


def _settle(store: Store, engine: EngineLike, outcome: ShardOutcome, stats: RunStats, *, cancelled: bool) -> None:
    """Add the run's accounting to the job; cancel what a cancel left unfinished, or count what a stop left."""
    outcome.stats = stats
    store.add_job_stats(
        outcome.job_id,
        prefill_tokens=stats.prefill_tokens,
        cache_hits=stats.cache_hits,
        cache_misses=stats.cache_misses,
        cache_evictions=stats.cache_evictions,
        peak_bytes=engine.cache.stats.peak_bytes,
    )
    if stats.unfinished or not stats.input_exhausted:
        if cancelled:
            outcome.cancelled += store.cancel_pending(outcome.job_id, list(stats.unfinished))
        else:
            outcome.left_pending = len(stats.unfinished)
            outcome.stopped = True


class ShardInput:
    """A shard's work items as the engine reads them, noting on the way what its plan needs: the common key
    prefix of its first prefix group and of its last one (what it can share with the shard before it and the one
    after: Store.record_shard_plan), whether every row is fresh, and whether all were read. Keys, not token ids:
    two different images after the same text have the same ids but share no positions.

    Items come in prefix order; a group's requests share their sort key's first chunk (jobs/sharding.py).
    """

    def __init__(self) -> None:
        self.placed: Iterable[tuple[WorkItem, bytes]] = ()
        """The work items and their sort keys (work_items over `rows`)."""
        self.exhausted = False
        self.fresh = True
        """No row read so far was started before (attempts 0)."""
        self._first: tuple[bytes, bytes] | None = None  # (group chunk, common key) of the first group
        self._last: tuple[bytes, bytes] | None = None

    def rows(self, pages: Iterable[list[PendingRequest]]) -> Iterator[PendingRequest]:
        """The rows of the store's pages, one after another."""
        for page in pages:
            self.fresh = self.fresh and all(r.attempts == 0 for r in page)
            yield from page

    def __iter__(self) -> Iterator[WorkItem]:
        for item, key in self.placed:
            chunk = key[:UNIT]
            if self._first is None:
                self._first = (chunk, item.prompt.key)
            elif self._first[0] == chunk:
                self._first = (chunk, common_key([self._first[1], item.prompt.key]))
            if self._last is None or self._last[0] != chunk:
                self._last = (chunk, item.prompt.key)
            else:
                self._last = (chunk, common_key([self._last[1], item.prompt.key]))
            yield item
        self.exhausted = True

    @property
    def lead(self) -> bytes:
        return self._first[1] if self._first is not None else b""

    @property
    def tail(self) -> bytes:
        return self._last[1] if self._last is not None else b""


def common_key(keys: list[bytes]) -> bytes:
    """The longest key prefix every key starts with (b"" for none)."""
    if not keys:
        return b""
    prefix = keys[0]
    for key in keys[1:]:
        prefix = key_prefix(prefix, common_prefix(prefix, key))
    return prefix
