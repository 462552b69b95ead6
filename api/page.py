"""What the web page shows, as JSON: the job list (paged, filtered), one job in detail, the live workers. The page
itself is static (api/static/) and renders these in the browser; api/page_requests.py serves a job's requests.

Every widget is one store query over an index range (the job list's rows, a job's live counts, its first
failures); the reads over all of a job's rows (counts, outcomes, histograms) go through api/page_cache.py.
"""

from __future__ import annotations

import time
import weakref
from typing import Any

from omlx_jobs.api.errors import BadRequest, NotFound
from omlx_jobs.api.ids import is_job_id
from omlx_jobs.api.page_cache import PageCache
from omlx_jobs.api.state import AppState
from omlx_jobs.api.tenants import EVERYONE, Tenant
from omlx_jobs.jobs import actions, lifecycle
from omlx_jobs.jobs.progress import PLOT_BINS, SAMPLE_BODIES, max_completion_tokens, model_name, shares
from omlx_jobs.jobs.progress import job_status as status_of
from omlx_jobs.jobs.workers import list_workers
from omlx_jobs.store.db import JobCounts, JobInfo
from omlx_jobs.store.errors import JobNotFound
from omlx_jobs.store.models import RequestStatus
from omlx_jobs.store.reports import HISTOGRAM_STEP, JobFilter

JOBS_PAGE = 50
LARGE_JOB = 50_000
"""A job with more requests than this has its list counts read on their own (and served stale while read)."""
JOBS_PAGE_MAX = 200
FIRST_ERRORS = 10
INPUT_ERRORS = 100
"""Validation errors sent with a job (the status JSON keeps them all, up to submit's cap)."""
HISTOGRAM_BINS = 24
WIDGET_WAIT = 0.5
"""Seconds a first view waits for a job's outcomes and histograms; a large job's come with a later refresh."""

_caches: weakref.WeakKeyDictionary[AppState, PageCache] = weakref.WeakKeyDictionary()


def cache_of(state: AppState) -> PageCache:
    """The server's one PageCache."""
    cache = _caches.get(state)
    if cache is None:
        cache = _caches[state] = PageCache()
    return cache


def _version(job: JobInfo) -> tuple[Any, ...]:
    return (job.status, job.in_progress_at, job.completed_at, job.cancelled_at, job.failed_at)


def _counts(state: AppState, job: JobInfo) -> JobCounts:
    ended = job.status in lifecycle.TERMINAL
    counts = cache_of(state).get(("counts", job.id), _version(job), lambda: state.store.counts(job.id), ended=ended)
    assert counts is not None  # no `wait`: the first read is waited for
    return counts


# ---- the job list ------------------------------------------------------------------------------------------


def _cursor(text: str | None) -> tuple[float, str] | None:
    if not text:
        return None
    at, sep, job_id = text.partition(",")
    try:
        if not sep or not is_job_id(job_id):
            raise ValueError(text)
        return float(at), job_id
    except ValueError:
        raise BadRequest(f"before={text!r} is not a cursor of this list: use its `next`", param="before") from None


def jobs_view(
    state: AppState,
    limit: int = JOBS_PAGE,
    *,
    status: str | None = None,
    model: str | None = None,
    q: str | None = None,
    before: str | None = None,
    tenant: Tenant = EVERYONE,
) -> dict[str, Any]:
    """A page of jobs (CLI and API alike), newest first: status, progress by outcome, short model name, age.
    Filters: status, model (short name or --model string), an id prefix; `before`: the last page's `next`."""
    if not 1 <= limit <= JOBS_PAGE_MAX:
        raise BadRequest(f"limit must be between 1 and {JOBS_PAGE_MAX}, got {limit}", param="limit")
    if status and status not in lifecycle.STATUSES:
        raise BadRequest(f"status must be one of {', '.join(lifecycle.STATUSES)}, got {status!r}", param="status")
    prefix = (q or "").strip() or None
    where = JobFilter(status=status or None, model=model or None, id_prefix=prefix, owner=tenant.scope)
    jobs = state.reports.jobs_page(where, before=_cursor(before), limit=limit + 1)
    more, jobs = len(jobs) > limit, jobs[:limit]
    counts = _status_counts(state, jobs)
    now = time.time()
    rows = [_job_row(job, counts[job.id], now) for job in jobs]
    last = jobs[-1] if jobs else None
    models = cache_of(state).get(("models",), None, state.reports.job_models)  # a few seconds stale at most
    return {
        "jobs": rows,
        "next": f"{last.created_at!r},{last.id}" if more and last else None,
        "filters": {"status": status, "model": model, "q": q},
        "statuses": list(lifecycle.STATUSES),
        "models": models,
        "now": now,
    }


def _status_counts(state: AppState, jobs: list[JobInfo]) -> dict[str, dict[str, int]]:
    """Requests by status of each listed job: those kept (ended jobs', large running jobs') from the cache, the
    rest in one query, kept as long as their read cost."""
    cache = cache_of(state)
    out: dict[str, dict[str, int]] = {}
    for job in jobs:
        found, counts = cache.peek(("status", job.id), _version(job))
        if found:
            out[job.id] = counts
        elif job.total > LARGE_JOB:  # its own read, served stale while a new one runs
            ended = job.status in lifecycle.TERMINAL
            read_one = lambda j=job.id: state.reports.status_counts([j])[j]  # noqa: E731
            out[job.id] = cache.get(("status", job.id), _version(job), read_one, ended=ended) or {}
    started = time.monotonic()
    read = state.reports.status_counts([j.id for j in jobs if j.id not in out])
    took = time.monotonic() - started
    for job in jobs:
        if job.id in read:
            cache.put(
                ("status", job.id), _version(job), read[job.id], took=took, ended=job.status in lifecycle.TERMINAL
            )
    return {**out, **read}


def _job_row(job: JobInfo, by_status: dict[str, int], now: float) -> dict[str, Any]:
    total = sum(by_status.values())
    c = {s: by_status.get(s, 0) for s in RequestStatus}
    done = c["completed"] + c["failed"] + c["cancelled"]
    counts = JobCounts(total, c["pending"], c["completed"], c["failed"], c["cancelled"], 0, 0, 0, None, None)
    return {
        "id": job.id,
        "status": job.status,
        "model": model_name(job),
        "created_at": job.created_at,
        "age_seconds": max(0.0, now - job.created_at),
        "total": total,
        "input_errors": len(job.errors or []),
        "done": done,
        **c,
        "shares": shares(counts),
        "progress": done / total if total else (1.0 if job.status in lifecycle.TERMINAL else 0.0),
    }


# ---- one job ---------------------------------------------------------------------------------------------


def get_job(state: AppState, job_id: str, tenant: Tenant = EVERYONE) -> JobInfo:
    """The job, if this tenant may see it: a batch another API key created is not there for it (api/tenants.py)."""
    if not is_job_id(job_id):
        raise NotFound(f"no job {job_id!r}", param="job_id", code="job_not_found")
    try:
        job = state.store.get_job(job_id)
    except JobNotFound:
        raise NotFound(f"no job {job_id!r} here", param="job_id", code="job_not_found") from None
    if tenant.scope is not None:
        batch = state.batches.get(job_id)
        if batch is not None and not tenant.sees(batch.owner):
            raise NotFound(f"no job {job_id!r} here", param="job_id", code="job_not_found")
    return job


def job_view(state: AppState, job_id: str, tenant: Tenant = EVERYONE) -> dict[str, Any]:
    """One job: its status with live figures (jobs/progress.py), the throughput plot, cache-hit share,
    outcomes, token histograms, its input errors with their lines, its first failed requests, and details."""
    job = get_job(state, job_id, tenant)
    cache, ended, version = cache_of(state), job.status in lifecycle.TERMINAL, _version(job)
    counts = _counts(state, job)
    max_tokens = cache.get(("max_tokens", job_id), None, lambda: _max_tokens(state, job_id), ended=True)
    summary = status_of(state.store, job_id, now=time.time(), max_tokens=max_tokens, plot=True, counts=counts)
    prompt = counts.prompt_tokens
    lookups = job.cache_hits + job.cache_misses
    outcomes = cache.get(
        ("outcomes", job_id), version, lambda: state.reports.outcomes(job_id), ended=ended, wait=WIDGET_WAIT
    )
    steps = cache.get(
        ("steps", job_id), version, lambda: state.reports.token_steps(job_id), ended=ended, wait=WIDGET_WAIT
    )
    errors = summary.pop("errors") or []
    if not summary["throughput_series"] and counts.completed:  # a job from before live counts: its results' times
        summary["throughput_series"] = _finished_series(state, job)
    return {
        **summary,
        "terminal": ended,
        "cancellable": not ended and job.status != lifecycle.CANCELLING,
        "cache": {
            "cached_token_share": counts.cached_tokens / prompt if prompt else None,
            "hit_share": job.cache_hits / lookups if lookups else None,
            "computed_over_minimum": summary["prefix"]["efficiency"],
        },
        "outcomes": outcomes,  # None: still being read (a large job's first view)
        "histograms": {kind: histogram(steps[kind]) for kind in ("prompt", "completion")} if steps else None,
        "errors": errors[:INPUT_ERRORS],
        "error_count": len(errors),
        "first_errors": state.reports.first_errors(job_id, FIRST_ERRORS),
        "batch": state.batches.get(job_id) is not None,
        "details": {"model": job.model, "queue": job.queue, "input_file": job.input_file},
        "now": time.time(),
    }


def _finished_series(state: AppState, job: JobInfo) -> list[dict[str, float]]:
    """Tokens per second by when requests finished (what older jobs have instead of live counts)."""
    buckets = cache_of(state).get(
        ("finished", job.id),
        _version(job),
        lambda: state.reports.throughput(job.id, PLOT_BINS),
        ended=job.status in lifecycle.TERMINAL,
    )
    return [
        {"t": b.start, "seconds": b.seconds, "prompt_tps": round(b.prompt_tokens_per_second, 2),
         "completion_tps": round(b.completion_tokens_per_second, 2)}
        for b in buckets or []
    ]  # fmt: skip


def _max_tokens(state: AppState, job_id: str) -> float | None:
    return max_completion_tokens(state.reports.sample_bodies(job_id, SAMPLE_BODIES))


def histogram(steps: dict[int, int], bins: int = HISTOGRAM_BINS) -> list[dict[str, int]]:
    """Counts by token count in HISTOGRAM_STEP steps, merged into at most `bins` equal bins from the smallest
    count to the largest: each {"lo": first tokens, "hi": last tokens + 1, "count"}."""
    if not steps:
        return []
    first, last = min(steps), max(steps)
    per_bin = -(-(last - first + 1) // bins)  # steps per bin, rounded up
    merged = [0] * (-(-(last - first + 1) // per_bin))
    for step, n in steps.items():
        merged[(step - first) // per_bin] += n
    width = per_bin * HISTOGRAM_STEP
    return [{"lo": (first + k * per_bin) * HISTOGRAM_STEP, "hi": (first + k * per_bin) * HISTOGRAM_STEP + width,
             "count": n} for k, n in enumerate(merged)]  # fmt: skip


# ---- workers, cancel ---------------------------------------------------------------------------------------


def workers_view(state: AppState) -> dict[str, Any]:
    """Live workers (their Redis records, jobs/workers.py) with their current rates."""
    try:
        workers = [w.to_dict() for w in list_workers(state.redis)]
        error = None
    except Exception as exc:
        workers, error = [], f"Redis unreachable: {exc}"
    return {"workers": workers, "error": error, "now": time.time()}


def cancel_job(state: AppState, job_id: str, tenant: Tenant = EVERYONE) -> dict[str, Any]:
    """The page's cancel button: any job (CLI or API) this tenant sees that has not ended."""
    job = get_job(state, job_id, tenant)
    if job.status in lifecycle.TERMINAL:
        raise BadRequest(f"job {job_id} is {job.status}; it can no longer be cancelled", code="job_not_cancellable")
    try:
        redis = state.redis
        redis.ping()
    except Exception:
        redis = None  # cancelled in the store; a running shard sees it within a second
    actions.cancel(state.store, redis, job_id)
    return job_view(state, job_id, tenant)
