"""Run one shard: read its pending requests from the store, generate them, commit each result at once.

Used by the RQ entry point (worker) and by `omlx-jobs run` (local, no Redis) alike.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from omlx_jobs.jobs import lifecycle
from omlx_jobs.jobs.formats import SamplingParams
from omlx_jobs.store import Store
from omlx_jobs.worker.engine import Control, Engine, ItemResult, RunStats, WorkItem
from omlx_jobs.worker.model import PromptError

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 10
"""A request started this many times without a result (worker crashes, engine errors) fails for good."""
STATUS_POLL_SECONDS = 1.0


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
    engine: Engine,
    job_id: str,
    start: int = 0,
    end: int | None = None,
    *,
    control: Callable[[], Control] | None = None,
    on_progress: Callable[[int], None] | None = None,
) -> ShardOutcome:
    """Generate every pending request of job `job_id` with position in [start, end)."""
    outcome = ShardOutcome(job_id, start, end if end is not None else -1)
    job = store.get_job(job_id)
    if job.status in lifecycle.TERMINAL:
        return outcome
    if job.status in (lifecycle.CANCELLING, lifecycle.CANCELLED):
        outcome.cancelled = store.cancel_pending(job_id)
        lifecycle.finalize_if_done(store, job_id)
        return outcome
    store.transition(job_id, lifecycle.IN_PROGRESS, only_from=[lifecycle.VALIDATING])

    pending = store.pending_requests(job_id, start, end)
    items: list[WorkItem] = []
    fresh = all(r.attempts == 0 for r in pending)
    for req in pending:
        if req.attempts >= MAX_ATTEMPTS:
            store.record_failure(
                req.id,
                "too_many_attempts",
                f"started {req.attempts} times without finishing (worker crashes or engine errors); "
                "run `omlx-jobs retry JOB` to try again",
            )
            outcome.failed += 1
            continue
        params = SamplingParams.from_body(req.body)
        tokens: list[int] = []
        try:
            tokens = engine.loaded.encode(req.endpoint, req.body)
            engine.check(tokens, params)
        except PromptError as exc:
            store.record_failure(req.id, exc.code, exc.message, prompt_tokens=len(tokens) or None)
            outcome.failed += 1
            continue
        items.append(WorkItem(req.id, tokens, params))

    def on_results(results: list[ItemResult]) -> None:
        outcome.completed += store.record_completions(
            [
                {
                    "id": r.key,
                    "output_text": r.choices[0].text,
                    "finish_reason": r.choices[0].finish_reason,
                    "prompt_tokens": r.prompt_tokens,
                    "cached_tokens": r.cached_tokens,
                    "completion_tokens": r.completion_tokens,
                    "more_choices": [{"text": c.text, "finish_reason": c.finish_reason} for c in r.choices[1:]] or None,
                    "started_at": r.started_at,
                }
                for r in results
            ]
        )
        if on_progress:
            on_progress(len(results))

    def on_plan(plan_stats: RunStats) -> None:
        # The trie minimum counts once per shard, on its first run; re-runs add only what they compute.
        if fresh:
            store.add_job_stats(job_id, trie_min_tokens=plan_stats.trie_min_tokens)

    watch = _JobWatch(store, job_id, control)
    stats = engine.run(items, on_results, watch, on_admit=store.mark_started, on_plan=on_plan)
    outcome.stats = stats
    store.add_job_stats(
        job_id,
        prefill_tokens=stats.prefill_tokens,
        cache_hits=stats.cache_hits,
        cache_misses=stats.cache_misses,
        cache_evictions=stats.cache_evictions,
        peak_bytes=engine.cache.stats.peak_bytes,
    )
    if stats.unfinished:
        if watch.cancelled:
            outcome.cancelled += store.cancel_pending(job_id, list(stats.unfinished))
        else:
            outcome.left_pending = len(stats.unfinished)
            outcome.stopped = True
    lifecycle.finalize_if_done(store, job_id)
    log.info("shard %s[%s:%s]: %s", job_id, start, end, outcome.to_dict())
    return outcome
