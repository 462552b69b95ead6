"""Job statuses (OpenAI's names), ids, finalization and the progress summary."""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

from omlx_jobs.jobs.model_names import display_name
from omlx_jobs.store import Store
from omlx_jobs.store.db import JobCounts, JobInfo
from omlx_jobs.store.models import JobStatus
from omlx_jobs.store.shards import WorkerShare

log = logging.getLogger(__name__)

VALIDATING = JobStatus.VALIDATING
IN_PROGRESS = JobStatus.IN_PROGRESS
FINALIZING = JobStatus.FINALIZING
COMPLETED = JobStatus.COMPLETED
FAILED = JobStatus.FAILED
CANCELLING = JobStatus.CANCELLING
CANCELLED = JobStatus.CANCELLED
# A batch created through the API whose completion window passed before it finished (`serve` sweeps it):
# its finished results are kept, the rest are cancelled with code batch_expired.
EXPIRED = JobStatus.EXPIRED

STATUSES = tuple(JobStatus)
TERMINAL = frozenset({COMPLETED, FAILED, CANCELLED, EXPIRED})


def new_job_id() -> str:
    return f"batch_{uuid.uuid4().hex[:24]}"


def finalize(store: Store, job_id: str) -> bool:
    """Move a job whose requests are all final to completed (or cancelled). True for the one caller that did:
    shards finishing together all call this, and the conditional transition lets exactly one through."""
    job = store.get_job(job_id)
    if job.status in TERMINAL or job.status == VALIDATING:
        return False
    if store.counts(job_id).pending:
        return False
    if job.status == CANCELLING:
        done = store.transition(job_id, CANCELLED, only_from=[CANCELLING])
    else:
        done = store.transition(job_id, FINALIZING, only_from=[IN_PROGRESS])
        if done:
            store.transition(job_id, COMPLETED, only_from=[FINALIZING])
    if done:
        log.info("job %s finalized: %s", job_id, store.get_job(job_id).status)
    return done


def finalize_if_done(store: Store, job_id: str) -> str:
    """finalize(), then the job's status."""
    finalize(store, job_id)
    return store.get_job(job_id).status


def summarize(
    job: JobInfo,
    counts: JobCounts,
    now: float | None = None,
    *,
    workers: list[WorkerShare] | None = None,
    serving: int | None = None,
) -> dict[str, Any]:
    """A JSON-ready view of a job: OpenAI-style fields plus tokens, throughput, ETA and prefix efficiency.

    `workers`: who ran the job's shards, with their request counts; `serving`: how many live workers listen
    on the job's queue (None when Redis was not asked).
    """
    now = time.time() if now is None else now
    start = counts.first_started_at
    end = counts.last_finished_at if counts.pending == 0 and counts.last_finished_at else now
    elapsed = max(end - start, 1e-9) if start else 0.0
    rate = counts.completed / elapsed if elapsed and counts.completed else 0.0
    eta = counts.pending / rate if rate and counts.pending and job.status not in TERMINAL else None
    return {
        "id": job.id,
        "object": "batch",
        "model": job.model,
        "model_name": job.model_name or display_name(job.model),
        "status": job.status,
        "input_file": job.input_file,
        "created_at": int(job.created_at),
        "in_progress_at": _int(job.in_progress_at),
        "completed_at": _int(job.completed_at),
        "cancelled_at": _int(job.cancelled_at),
        "failed_at": _int(job.failed_at),
        "request_counts": {
            "total": counts.total,
            "completed": counts.completed,
            "failed": counts.failed,
            "cancelled": counts.cancelled,
            "pending": counts.pending,
        },
        "progress": counts.done / counts.total if counts.total else (1.0 if job.status in TERMINAL else 0.0),
        "usage": _usage(counts),
        "throughput": {
            "requests_per_second": round(rate, 3),
            "completion_tokens_per_second": round(counts.completion_tokens / elapsed if elapsed else 0.0, 2),
            # An embeddings job generates nothing: its rate is the prompt tokens it embedded.
            "prompt_tokens_per_second": round(counts.prompt_tokens / elapsed if elapsed else 0.0, 2),
            "elapsed_seconds": round(elapsed, 2),
        },
        "eta_seconds": round(eta, 1) if eta is not None else None,
        "prefix": _prefix(job, workers),
        "errors": job.errors,
        "priority": job.options.get("priority", "normal"),
        "queue": job.queue,
        "workers": [_worker(w) for w in workers or []],
        "live_workers": serving,
    }


def _usage(counts: JobCounts) -> dict[str, Any]:
    return {
        "prompt_tokens": counts.prompt_tokens,
        "completion_tokens": counts.completion_tokens,
        "total_tokens": counts.prompt_tokens + counts.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": counts.cached_tokens},
    }


def _prefix(job: JobInfo, workers: list[WorkerShare] | None) -> dict[str, Any]:
    """Prefix efficiency: prefill computed against the trie's minimum, and the prefix cache's figures. The
    computed figure is partial when shard runs were killed or failed before adding their prefill."""
    efficiency = job.prefill_tokens / job.trie_min_tokens if job.trie_min_tokens else None
    unsettled = sum(w.unsettled_runs for w in workers or [])
    return {
        "prefill_tokens_computed": job.prefill_tokens,
        "trie_min_tokens": job.trie_min_tokens,
        "unsettled_runs": unsettled,
        "partial": bool(unsettled) and job.status in TERMINAL,
        "efficiency": round(efficiency, 4) if efficiency is not None else None,
        "cache_hits": job.cache_hits,
        "cache_misses": job.cache_misses,
        "cache_evictions": job.cache_evictions,
        "cache_peak_bytes": job.cache_peak_bytes,
    }


def _worker(w: WorkerShare) -> dict[str, Any]:
    return {
        "worker": w.worker,
        "model": w.model,
        "completed": w.completed,
        "failed": w.failed,
        "shard_runs": w.shard_runs,
    }


def _int(value: float | None) -> int | None:
    return int(value) if value is not None else None
