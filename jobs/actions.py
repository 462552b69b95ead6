"""What the CLI commands do, as functions tests call too: submit, cancel, retry, resume."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from redis import Redis

from omlx_jobs.jobs import lifecycle
from omlx_jobs.jobs.queue import (
    DEFAULT_SHARD_TIMEOUT,
    RedisUnavailable,
    Shard,
    cancel_queued,
    enqueue_shards,
    plan_shards,
    queue_name,
)
from omlx_jobs.jobs.submit import LoadResult, load_job
from omlx_jobs.store import Store


@dataclass
class Submitted:
    load: LoadResult
    queue: str
    enqueued: list[str]


def submit(
    store: Store,
    redis: Redis,
    path: Path,
    model: str,
    *,
    queue: str | None = None,
    skip_invalid: bool = False,
    shard_size: int | None = None,
    shard_timeout: int = DEFAULT_SHARD_TIMEOUT,
    on_progress: Callable[[int], None] | None = None,
) -> Submitted:
    """Validate and store the file, then enqueue its shards. Redis is checked first, so a down Redis
    leaves no job behind; if it fails midway, the job stays 'validating' and `resume` enqueues it."""
    qname = queue or queue_name(model)
    try:
        redis.ping()
    except Exception as exc:
        raise RedisUnavailable(f"cannot reach Redis before submitting ({exc}); nothing was stored") from exc
    loaded = load_job(store, path, model, skip_invalid=skip_invalid, queue=qname, on_progress=on_progress)
    if loaded.rejected:
        return Submitted(loaded, qname, [])
    ids = enqueue(store, redis, loaded.job_id, shard_size=shard_size, shard_timeout=shard_timeout)
    return Submitted(loaded, qname, ids)


def enqueue(
    store: Store,
    redis: Redis,
    job_id: str,
    *,
    shard_size: int | None = None,
    shard_timeout: int = DEFAULT_SHARD_TIMEOUT,
    suffix: str = "",
) -> list[str]:
    job = store.get_job(job_id)
    shards = [Shard(s.job_id, s.start, s.end, suffix=suffix) for s in plan_shards(job_id, job.total, shard_size)]
    ids = enqueue_shards(redis, job.queue or queue_name(job.model), shards, timeout=shard_timeout)
    store.transition(job_id, lifecycle.IN_PROGRESS, only_from=[lifecycle.VALIDATING])
    return ids


def resume(store: Store, redis: Redis, job_id: str) -> list[str]:
    """Enqueue a job again: one left 'validating' by a failed submit, or one whose shards were lost."""
    import uuid

    job = store.get_job(job_id)
    if job.status in lifecycle.TERMINAL:
        raise ValueError(f"job {job_id} is {job.status}; use `omlx-jobs retry` to run failed requests again")
    if job.total == 0:
        raise ValueError(f"job {job_id} has no requests to run")
    return enqueue(store, redis, job_id, suffix=f"-r{uuid.uuid4().hex[:8]}")


def cancel(store: Store, redis: Redis | None, job_id: str) -> str:
    """Cancel a job: queued shards are dropped, running ones stop within a second, finished results stay."""
    job = store.get_job(job_id)
    if job.status in lifecycle.TERMINAL:
        return job.status
    store.transition(job_id, lifecycle.CANCELLING)
    running = 0
    if redis is not None and job.queue:
        _, running = cancel_queued(redis, job.queue, job_id)
    if running == 0:
        # No worker holds a shard: nothing is in flight, so cancel what is left right away.
        store.cancel_pending(job_id)
    return lifecycle.finalize_if_done(store, job_id)


def retry(store: Store, redis: Redis, job_id: str, *, include_cancelled: bool = False) -> int:
    """Put failed (and optionally cancelled) requests back to pending and enqueue the job. Returns how many."""
    job = store.get_job(job_id)
    if job.status not in lifecycle.TERMINAL:
        raise ValueError(f"job {job_id} is still {job.status}; wait for it to finish or cancel it first")
    n = store.reset_for_retry(job_id, include_cancelled=include_cancelled)
    if n == 0:
        return 0
    store.update_job(job_id, completed_at=None, cancelled_at=None, cancelling_at=None)
    store.transition(job_id, lifecycle.VALIDATING)
    import uuid

    enqueue(store, redis, job_id, suffix=f"-t{uuid.uuid4().hex[:8]}")
    return n


def reconcile(store: Store, redis: Redis, queue: str) -> list[str]:
    """Re-enqueue jobs on `queue` that have pending requests but no shard in Redis; returns their ids.

    Redis carries only messages. After a Redis restart without persistence, or a shard whose retries ran
    out, the store still knows what is left; a cancelling job with nothing running is finished here.
    """
    from rq.registry import DeferredJobRegistry, ScheduledJobRegistry, StartedJobRegistry

    from omlx_jobs.jobs.queue import get_queue

    q = get_queue(redis, queue)
    live = set(q.get_job_ids())
    for registry in (StartedJobRegistry, ScheduledJobRegistry, DeferredJobRegistry):
        live.update(registry(queue=q).get_job_ids())
    requeued = []
    for job_id in store.jobs_with_pending(queue, [lifecycle.IN_PROGRESS, lifecycle.CANCELLING]):
        if any(rq_id.startswith(f"{job_id}--") for rq_id in live):
            continue
        if store.get_job(job_id).status == lifecycle.CANCELLING:
            store.cancel_pending(job_id)
            lifecycle.finalize_if_done(store, job_id)
            continue
        import uuid

        enqueue(store, redis, job_id, suffix=f"-c{uuid.uuid4().hex[:8]}")
        requeued.append(job_id)
    return requeued
