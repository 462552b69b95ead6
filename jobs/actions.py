"""What the CLI commands do, as functions tests call too: submit, cancel, retry, resume."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from redis import Redis

from omlx_jobs import defaults
from omlx_jobs.errors import SERVER_ERROR_CODES
from omlx_jobs.jobs import lifecycle
from omlx_jobs.jobs.formats import NO_FILES
from omlx_jobs.jobs.images import ImageAccess
from omlx_jobs.jobs.lease import fail_interrupted
from omlx_jobs.jobs.queue import (
    DEFAULT_SHARD_TIMEOUT,
    RedisUnavailable,
    Shard,
    cancel_queued,
    enqueue_shards,
    queue_name,
    with_priority,
)
from omlx_jobs.jobs.submit import LoadResult, check_model, load_job
from omlx_jobs.store import Store
from omlx_jobs.store.db import JobInfo
from omlx_jobs.store.shards import ShardInfo

RECONCILE_LOCK_SECONDS = 60
IN_TRANSIT_SECONDS = 0.5
"""How long reconcile waits before it looks again at shards it found nowhere in Redis (see reconcile)."""
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
    priority: str = "normal",
    skip_invalid: bool = False,
    shard_size: int | None = None,
    shard_timeout: int = DEFAULT_SHARD_TIMEOUT,
    on_progress: Callable[[int], None] | None = None,
    images: ImageAccess = NO_FILES,
    job_id: str | None = None,
    lease_seconds: float = defaults.SUBMIT_LEASE,
    model_name: str | None = None,
) -> Submitted:
    """Validate and store the file in prefix order, cut it into shards and enqueue them on the queue of
    `priority`. Redis is checked first, so a down Redis leaves no job behind; if it fails midway, the job
    stays 'validating' and `resume` enqueues it. `model_name`: the model's short name (`--model-name`, an
    API alias); by default the model's stem (jobs/model_names.py)."""
    check_model(model)
    qname = with_priority(queue, priority) if queue else queue_name(model, priority)
    try:
        redis.ping()
    except Exception as exc:
        raise RedisUnavailable(f"cannot reach Redis before submitting ({exc}); nothing was stored") from exc
    # Kept with the job: shards enqueued again later (reconcile, resume, retry) are timed the same way.
    options = {"shard_size": shard_size, "shard_timeout": shard_timeout, "priority": priority}
    loaded = load_job(
        store,
        path,
        model,
        skip_invalid=skip_invalid,
        queue=qname,
        shard_size=shard_size,
        options=options,
        on_progress=on_progress,
        images=images,
        job_id=job_id,
        lease_seconds=lease_seconds,
        model_name=model_name if model_name != model else None,
    )
    if loaded.rejected:
        return Submitted(loaded, qname, [])
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
    """Enqueue the job's shards that hold requests without a result, cut at submit and timed as then."""
    job = store.get_job(job_id)
    shards = [Shard(job_id, s.first_pos, s.end_pos, suffix=suffix) for s in store.shards(job_id, pending_only=True)]
    ids = enqueue_shards(redis, job.queue or queue_name(job.model), shards, timeout=shard_timeout_of(job))
    store.transition(job_id, lifecycle.IN_PROGRESS, only_from=[lifecycle.VALIDATING])
    return ids


class JobBusy(ValueError):
    """The job still has shards queued or running; the message says what to do."""


def resume(store: Store, redis: Redis, job_id: str) -> list[str]:
    """Enqueue a job again: one left 'validating' by a failed submit, or one whose shards were lost.

    Refused while any shard of the job is queued or running: a second copy would run the same requests on
    two workers and charge their attempts twice.
    """
    job = store.get_job(job_id)
    if job.status in lifecycle.TERMINAL:
        if job.status == lifecycle.FAILED and job.total == 0 and job.errors:  # rejected, or its submit died
            raise ValueError(f"job {job_id} failed at submit: {job.errors[0].get('message')}; nothing to resume")
        raise ValueError(f"job {job_id} is {job.status}; use `omlx-jobs retry` to run failed requests again")
    if job.status == lifecycle.VALIDATING and job.total == 0:
        _refuse_unstored(store, job)
    if job.total == 0:
        raise ValueError(f"job {job_id} has no requests to run")
    live = job_shards_in_redis(redis, job)
    if live:
        raise JobBusy(
            f"job {job_id} is running: {len(live)} shard(s) queued or started; nothing to resume. "
            f"Wait for it (`omlx-jobs status {job_id}`), or cancel it first"
        )
    return enqueue(store, redis, job_id, suffix=f"-r{uuid.uuid4().hex[:8]}")


def _refuse_unstored(store: Store, job: JobInfo) -> None:
    """A validating job whose file was never stored whole: its submit is still at work, or it died."""
    now = time.time()
    if job.submit_lease_until is not None and job.submit_lease_until >= now:
        raise JobBusy(
            f"job {job.id} is still being submitted: its submit holds it for {job.submit_lease_until - now:.0f} s "
            f"more and renews that while it stores the file. Wait for it (`omlx-jobs status {job.id}`)"
        )
    stored = fail_interrupted(store, job.id, now)
    if stored is None:  # it changed meanwhile: say what it is now
        raise ValueError(f"job {job.id} is {store.get_job(job.id).status} now; run `omlx-jobs status {job.id}`")
    raise ValueError(
        f"job {job.id}'s submit stopped before the whole file was stored ({stored} request(s) stored, none "
        "queued): it was killed, or lost its machine or the store. The job is now failed; submit the file again"
    )


def job_shards_in_redis(redis: Redis, job: JobInfo) -> list[str]:
    """RQ ids of the job's shards that Redis holds: waiting, being taken, running, scheduled or deferred."""
    return sorted(
        rq_id for rq_id in live_shards(redis, job.queue or queue_name(job.model)) if rq_id.startswith(f"{job.id}--")
    )


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


def cancel_report(store: Store, redis: Redis | None, job_id: str) -> str:
    """cancel(), said in a line: what was cancelled, or that nothing was (the job had ended already)."""
    before = store.get_job(job_id).status
    if before in lifecycle.TERMINAL:
        return f"{job_id} is already {before}: nothing was cancelled"
    status = cancel(store, redis, job_id)
    counts = store.counts(job_id)
    if status == lifecycle.CANCELLED:
        return f"{job_id}: cancelled ({counts.cancelled} request(s) cancelled, {counts.completed} result(s) kept)"
    if status in lifecycle.TERMINAL:
        return f"{job_id} ended as {status} before the cancel: nothing was cancelled"
    return f"{job_id}: {status} (running shards stop within a second; finished results are kept)"


def retry(store: Store, redis: Redis, job_id: str, *, include_cancelled: bool = False) -> int:
    """Put failed (and optionally cancelled) requests back to pending and enqueue the job. Returns how many."""
    job = store.get_job(job_id)
    if job.status not in lifecycle.TERMINAL:
        raise ValueError(f"job {job_id} is still {job.status}; wait for it to finish or cancel it first")
    n = store.reset_for_retry(job_id, include_cancelled=include_cancelled, retry_codes=SERVER_ERROR_CODES)
    if n == 0:
        return 0
    store.update_job(job_id, completed_at=None, cancelled_at=None, cancelling_at=None)
    store.reset_shard_failures(job_id)
    store.transition(job_id, lifecycle.VALIDATING)
    _enqueue_or_explain(store, redis, job_id, suffix=f"-t{uuid.uuid4().hex[:8]}")
    return n


@dataclass
class Reconciled:
    requeued: list[str] = field(default_factory=list)
    """Jobs that got shards again."""
    deferred: bool = False
    """Nothing was decided: another worker is reconciling the queue, or Redis restarted moments ago."""
    failed_submits: list[str] = field(default_factory=list)
    """Jobs left validating by a submit that died (their lease passed), now failed."""


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
        now = time.time()
        done.failed_submits = [
            j for j in store.lapsed_submits(queue, now) if fail_interrupted(store, j, now) is not None
        ]
        live = live_shards(redis, queue)
        jobs = [store.get_job(j) for j in store.jobs_with_pending(queue, [lifecycle.IN_PROGRESS, lifecycle.CANCELLING])]
        lost = {job.id: _lost_shards(store, job.id, live) for job in jobs if job.status != lifecycle.CANCELLING}
        if any(lost.values()):
            # A worker serving several queues (priorities) pops a shard with BLPOP: until it registers the shard
            # as started, a few milliseconds later, the shard is nowhere in Redis. Look again before calling it lost.
            time.sleep(IN_TRANSIT_SECONDS)
            live = live_shards(redis, queue)
            lost = {job_id: _lost_shards(store, job_id, live) for job_id in lost}
        for job in jobs:
            if job.status == lifecycle.CANCELLING:
                if not any(rq_id.startswith(f"{job.id}--") for rq_id in live):
                    store.cancel_pending(job.id)
                    lifecycle.finalize_if_done(store, job.id)
            elif lost[job.id]:
                suffix = f"-c{uuid.uuid4().hex[:8]}"
                shards = [Shard(job.id, s.first_pos, s.end_pos, suffix=suffix) for s in lost[job.id]]
                enqueue_shards(redis, queue, shards, timeout=shard_timeout_of(job))
                done.requeued.append(job.id)
        return done
    finally:
        with contextlib.suppress(LockError):
            lock.release()


def _lost_shards(store: Store, job_id: str, live: set[str]) -> list[ShardInfo]:
    """The job's shards holding pending requests whose message is nowhere in Redis (`live`: live_shards)."""
    bases = {shard_base_id(rq_id) for rq_id in live}
    return [
        s for s in store.shards(job_id, pending_only=True) if Shard(job_id, s.first_pos, s.end_pos).rq_id not in bases
    ]


def shard_base_id(rq_id: str) -> str:
    """An RQ id without the suffix a re-enqueue adds: JOB--START-END (see queue.Shard.rq_id)."""
    job, sep, rest = rq_id.partition("--")
    return job + sep + "-".join(rest.split("-")[:2])


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
