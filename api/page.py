"""What the web page shows, as JSON: the jobs list, one job in detail, the workers. The page itself is static
(api/static/) and renders these in the browser."""

from __future__ import annotations

import time
from typing import Any

from omlx_jobs.api.errors import BadRequest, NotFound
from omlx_jobs.api.ids import is_job_id
from omlx_jobs.api.state import AppState
from omlx_jobs.api.workers import list_workers
from omlx_jobs.jobs import actions, lifecycle
from omlx_jobs.store.errors import JobNotFound

MAX_POINTS = 60
FIRST_ERRORS = 10


def jobs_view(state: AppState, limit: int = 50) -> dict[str, Any]:
    """Recent jobs (CLI and API alike): status, progress, model, age."""
    now = time.time()
    rows = []
    for job in state.store.list_jobs(limit):
        counts = state.store.counts(job.id)
        done = counts.completed + counts.failed + counts.cancelled
        rows.append(
            {
                "id": job.id,
                "status": job.status,
                "model": job.model,
                "created_at": job.created_at,
                "age_seconds": max(0.0, now - job.created_at),
                "total": counts.total,
                "done": done,
                "completed": counts.completed,
                "failed": counts.failed,
                "progress": done / counts.total if counts.total else (1.0 if job.status in lifecycle.TERMINAL else 0.0),
            }
        )
    return {"jobs": rows, "now": now}


def job_view(state: AppState, job_id: str) -> dict[str, Any]:
    """One job: the status summary (progress, ETA, tokens, prefix efficiency), throughput over time, cache-hit
    share, the first errors, and whether it can still be cancelled."""
    if not is_job_id(job_id):
        raise NotFound(f"no job {job_id!r}", param="job_id")
    try:
        job = state.store.get_job(job_id)
    except JobNotFound:
        raise NotFound(f"no job {job_id!r}", param="job_id") from None
    counts = state.store.counts(job_id)
    summary = lifecycle.summarize(job, counts)
    prompt = counts.prompt_tokens
    lookups = job.cache_hits + job.cache_misses
    buckets = state.reports.throughput(job_id, MAX_POINTS)
    return {
        **summary,
        "terminal": job.status in lifecycle.TERMINAL,
        "cancellable": job.status not in lifecycle.TERMINAL and job.status != lifecycle.CANCELLING,
        "cache": {
            "cached_token_share": counts.cached_tokens / prompt if prompt else None,
            "hit_share": job.cache_hits / lookups if lookups else None,
            "computed_over_minimum": summary["prefix"]["efficiency"],
        },
        "throughput_series": [
            {
                "t": b.start,
                "seconds": b.seconds,
                "prompt_tps": round(b.prompt_tokens_per_second, 2),
                "completion_tps": round(b.completion_tokens_per_second, 2),
                "completed": b.completed,
            }
            for b in buckets
        ],
        "first_errors": state.reports.first_errors(job_id, FIRST_ERRORS),
        "batch": state.batches.get(job_id) is not None,
        "now": time.time(),
    }


def workers_view(state: AppState) -> dict[str, Any]:
    try:
        workers = [w.to_dict() for w in list_workers(state.redis)]
        error = None
    except Exception as exc:
        workers, error = [], f"Redis unreachable: {exc}"
    return {"workers": workers, "error": error, "now": time.time()}


def cancel_job(state: AppState, job_id: str) -> dict[str, Any]:
    """The page's cancel button: any job (CLI or API) that has not ended."""
    view = job_view(state, job_id)
    if view["terminal"]:
        raise BadRequest(f"job {job_id} is {view['status']}; it can no longer be cancelled", code="job_not_cancellable")
    try:
        redis = state.redis
        redis.ping()
    except Exception:
        redis = None  # cancelled in the store; a running shard sees it within a second
    actions.cancel(state.store, redis, job_id)
    return job_view(state, job_id)
