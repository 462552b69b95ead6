"""What the CLI commands do, as functions tests call too: submit, cancel, retry, resume."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from redis import Redis

from omlx_jobs.jobs import lifecycle
from omlx_jobs.jobs.output import SERVER_ERROR_CODES
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
from omlx_jobs.store.db import JobInfo

RECONCILE_LOCK_SECONDS = 60
"""A worker that dies while reconciling holds the lock this long at most."""


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
    job_id: str | None = None,
) -> Submitted:
    """Validate and store the file, then enqueue its shards. Redis is checked first, so a down Redis
    leaves no job behind; if it fails midway, the job stays 'validating' and `resume` enqueues it."""
    qname = queue or queue_name(model)
    try:
        redis.ping()
    except Exception as exc:
        raise RedisUnavailable(f"cannot reach Redis before submitting ({exc}); nothing was stored") from exc
    loaded = load_job(
        store, path, model, skip_invalid=skip_invalid, queue=qname, on_progress=on_progress, job_id=job_id
    )
    if loaded.rejected:
        return Submitted(loaded, qname, [])
    # Kept with the job: shards enqueued again later (reconcile, resume, retry) are cut and timed the same way.
    options = {**store.get_job(loaded.job_id).options, "shard_size": shard_size, "shard_timeout": shard_timeout}
    store.update_job(loaded.job_id, options=options)
    return Submitted(loaded, qname, _enqueue_or_explain(store, redis, loaded.job_id))


def _enqueue_or_explain(store: Store, redis: Redis, job_id: str, suffix: str = "") -> list[str]:
    """enqueue, and if Redis fails midway, say which job to `resume` (its requests are stored)."""
    try:
        return enqueue(store, redis, job_id, suffix=suffix)
    except RedisUnavailable as exc:
        raise RedisUnavailable(f"{exc}. Job {job_id} is stored but not queued: `omlx-jobs resume {job_id}`") from exc


def shard_timeout_of(job: JobInfo) -> int:
    """Seconds one shard of `job` may run (submit --shard-timeout)."""
    return int(job.options.get("shard_timeout") or DEFAULT_SHARD_TIMEOUT)


def enqueue(store: Store, redis: Redis, job_id: str, *, suffix: str = "") -> list[str]:
    """Enqueue every shard of the job, cut and timed as at submit; requests with a result are skipped when run."""
    job = store.get_job(job_id)
    shards = plan_shards(job_id, job.total, job.options.get("shard_size"))
    shards = [Shard(s.job_id, s.start, s.end, suffix=suffix) for s in shards]
    ids = enqueue_shards(redis, job.queue or queue_name(job.model), shards, timeout=shard_timeout_of(job))
    store.transition(job_id, lifecycle.IN_PROGRESS, only_from=[lifecycle.VALIDATING])
    return ids


def resume(store: Store, redis: Redis, job_id: str) -> list[str]:
    """Enqueue a job again: one left 'validating' by a failed submit, or one whose shards were lost."""
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
    n = store.reset_for_retry(job_id, include_cancelled=include_cancelled, retry_codes=SERVER_ERROR_CODES)
    if n == 0:
        return 0
    store.update_job(job_id, completed_at=None, cancelled_at=None, cancelling_at=None)
    store.transition(job_id, lifecycle.VALIDATING)
    _enqueue_or_explain(store, redis, job_id, suffix=f"-t{uuid.uuid4().hex[:8]}")
    return n


@dataclass
class Reconciled:
    requeued: list[str] = field(default_factory=list)
    """Jobs that got shards again."""
    deferred: bool = False
    """Nothing was decided: another worker is reconciling the queue, or Redis restarted moments ago."""


def reconcile(store: Store, redis: Redis, queue: str, *, grace: float = 0.0) -> Reconciled:
    """Re-enqueue jobs on `queue` that have pending requests but no shard in Redis.

    Redis carries only messages. After a Redis restart without persistence, or a shard whose retries ran
    out, the store still knows what is left; a cancelling job with nothing running is finished here.
    One worker reconciles a queue at a time (a lock), and not before Redis has been up `grace` seconds:
    running workers claim their shards again with their next heartbeat, so they are not handed out twice.
    """
    from redis.exceptions import LockError

    lock = redis.lock(f"omlx:reconcile:{queue}", timeout=RECONCILE_LOCK_SECONDS, blocking=False)
    if not lock.acquire():
        return Reconciled(deferred=True)
    try:
        if grace and int(redis.info("server").get("uptime_in_seconds", grace)) < grace:
            return Reconciled(deferred=True)
        done = Reconciled()
        live = live_shards(redis, queue)
        for job_id in store.jobs_with_pending(queue, [lifecycle.IN_PROGRESS, lifecycle.CANCELLING]):
            if any(rq_id.startswith(f"{job_id}--") for rq_id in live):
                continue
            if store.get_job(job_id).status == lifecycle.CANCELLING:
                store.cancel_pending(job_id)
                lifecycle.finalize_if_done(store, job_id)
                continue
            enqueue(store, redis, job_id, suffix=f"-c{uuid.uuid4().hex[:8]}")
            done.requeued.append(job_id)
        return done
    finally:
        with contextlib.suppress(LockError):
            lock.release()


def live_shards(redis: Redis, queue: str) -> set[str]:
    """RQ ids of the shards Redis still holds for `queue`: waiting, being dequeued, running, scheduled, deferred.

    Abandoned shards are requeued first (RQ's cleanup), then every place a shard can be is read in one
    transaction: a shard moving queue -> intermediate -> started between separate reads would look lost.
    """
    from rq.registry import DeferredJobRegistry, ScheduledJobRegistry, StartedJobRegistry

    from omlx_jobs.jobs.queue import get_queue

    q = get_queue(redis, queue)
    started = StartedJobRegistry(queue=q)
    started.cleanup()
    registries = (started, ScheduledJobRegistry(queue=q), DeferredJobRegistry(queue=q))
    with redis.pipeline(transaction=True) as pipe:
        pipe.lrange(q.key, 0, -1)
        pipe.lrange(q.intermediate_queue_key, 0, -1)
        for registry in registries:
            pipe.zrange(registry.key, 0, -1)
        waiting, dequeued, *members = pipe.execute()
    live = {x.decode() if isinstance(x, bytes) else x for x in (*waiting, *dequeued)}
    for registry, entries in zip(registries, members, strict=True):
        live.update(registry.parse_job_id(e) for e in entries)
    return live
