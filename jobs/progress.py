"""A job's status with its live figures: the summary of jobs/lifecycle.py plus tokens per second now, requests in
flight, the ETA from tokens, the shares of completed, failed and cancelled requests, and the model's short name.
`status` (text and --json), the page and /metrics all read it from here.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any

from omlx_jobs.jobs import lifecycle
from omlx_jobs.jobs.model_names import display_name
from omlx_jobs.jobs.params import SamplingParams
from omlx_jobs.jobs.throughput import Progress, Span, current, estimate, series
from omlx_jobs.store import Store
from omlx_jobs.store.db import JobCounts, JobInfo
from omlx_jobs.store.reports import Reports

SAMPLE_BODIES = 200
"""Requests whose max_tokens give the expected answer length before enough requests finished."""
PLOT_BINS = 60


def model_name(job: JobInfo) -> str:
    """The job's model, short: as stored at submit, else derived from its --model string."""
    return job.model_name or display_name(job.model)


def max_completion_tokens(bodies: Iterable[dict[str, Any]]) -> float | None:
    """The mean of max_tokens x n over request bodies (what an answer may run to), or None for none."""
    limits = []
    for body in bodies:
        if "input" in body:  # an embeddings body: it generates nothing (the ETA counts its prompt tokens)
            limits.append(0)
            continue
        try:
            params = SamplingParams.from_body(body)
        except (TypeError, ValueError):  # a body the validator let through in another version: skip it
            continue
        limits.append(params.max_tokens * params.n)
    return sum(limits) / len(limits) if limits else None


def shares(counts: JobCounts) -> dict[str, float]:
    """The requests' shares by state, for a bar of completed, failed and cancelled (and pending) parts."""
    total = counts.total or 1
    return {
        "completed": counts.completed / total,
        "failed": counts.failed / total,
        "cancelled": counts.cancelled / total,
        "pending": counts.pending / total,
    }


def live_figures(
    job: JobInfo, counts: JobCounts, spans: Sequence[Span], max_tokens: float | None, now: float
) -> dict[str, Any]:
    """The live part of a job's status (pure): current rates, in flight, the counted totals, the ETA."""
    terminal = job.status in lifecycle.TERMINAL
    rates = current([] if terminal else spans, now)
    counted_prompt = sum(s.prompt_tokens for s in spans)
    counted_completion = sum(s.completion_tokens for s in spans)
    counted_seconds = max(s.ended_at for s in spans) - min(s.started_at for s in spans) if spans else 0.0
    progress = Progress(
        pending=counts.pending,
        completed=counts.completed,
        completion_tokens=counts.completion_tokens,
        counted_completion_tokens=counted_completion,
        counted_seconds=counted_seconds,
        max_completion_tokens=max_tokens,
        prompt_tokens=counts.prompt_tokens,
        cached_tokens=counts.cached_tokens,
    )
    eta = estimate(progress, rates, terminal=terminal)
    return {
        "live": {
            **rates.to_dict(),
            "prefilled_tokens": counted_prompt,
            "generated_tokens": counted_completion,
            "counted_seconds": round(counted_seconds, 2),
            "as_of": max((s.ended_at for s in spans), default=None),
        },
        "eta": eta.to_dict(),
        "eta_seconds": eta.to_dict()["eta_seconds"],
        "shares": shares(counts),
    }


def throughput_series(spans: Sequence[Span], job: JobInfo, now: float) -> list[dict[str, float]]:
    """The plot: tokens per second over the job's life, binned by when they were computed."""
    end = None if job.status in lifecycle.TERMINAL else now
    return [b.to_dict() for b in series(spans, PLOT_BINS, end=end)]


def job_status(
    store: Store,
    job_id: str,
    *,
    serving: int | None = None,
    now: float | None = None,
    max_tokens: float | None = None,
    plot: bool = False,
    counts: JobCounts | None = None,
) -> dict[str, Any]:
    """A job's whole status (lifecycle.summarize's fields and live_figures'), from the store.

    `serving`: live workers on its queue (None: Redis not asked); `max_tokens`: the requests' mean max_tokens
    when the caller knows it already (the page keeps it per job), else read from a sample of the requests;
    `plot`: add `throughput_series`, from the same live counts; `counts`: the job's request counts when the
    caller has them (the page keeps them a while for a large job).
    """
    now = time.time() if now is None else now
    job = store.get_job(job_id)
    counts = counts if counts is not None else store.counts(job_id)
    summary = lifecycle.summarize(job, counts, now, workers=store.job_workers(job_id), serving=serving)
    spans = store.job_ticks(job_id)
    if max_tokens is None and counts.pending:
        max_tokens = max_completion_tokens(Reports(store).sample_bodies(job_id, SAMPLE_BODIES))
    summary.update(live_figures(job, counts, spans, max_tokens, now))
    if plot:
        summary["throughput_series"] = throughput_series(spans, job, now)
    return summary
