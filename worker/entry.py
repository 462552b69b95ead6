"""The RQ entry point of a shard: `run_shard`, whose import path queued messages name (jobs/queue.SHARD_FUNC).

RQ calls it with JSON arguments; it runs the shard in the worker process's context (runtime/context.py, which
`omlx-jobs worker` installs through `install`), where the model stays loaded between shards.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from rq.timeouts import JobTimeoutException

from omlx_jobs.errors import OmlxError
from omlx_jobs.jobs.actions import shard_timeout_of
from omlx_jobs.jobs.queue import Shard, enqueue_shards
from omlx_jobs.store import StoreError, StoreUnavailable
from omlx_jobs.store.db import JobNotFound
from omlx_jobs.worker.runtime import reconnect, shard
from omlx_jobs.worker.runtime.context import WorkerContext, current, install
from omlx_jobs.worker.runtime.report import ShardTalk

__all__ = ["UnknownJob", "WorkerContext", "current", "install", "run_shard"]  # the context: runtime/context.py

log = logging.getLogger(__name__)


class UnknownJob(OmlxError, LookupError):
    """A shard message names a job that is not in this worker's store."""


def run_shard(job_id: Any, start: Any, end: Any) -> dict[str, Any]:
    """Run one shard of a job; hands unfinished requests back to the queue if the worker is stopping."""
    if not isinstance(job_id, str) or not all(isinstance(x, int) and not isinstance(x, bool) for x in (start, end)):
        raise ValueError(f"bad shard message: ({job_id!r}, {start!r}, {end!r})")
    ctx = current()
    ctx.current = (job_id, start, end)
    if ctx.on_shard is not None:
        ctx.on_shard()  # `omlx-jobs workers` shows the shard now, not at the next heartbeat
    talk = ShardTalk(ctx.engine, job_id, start, end)
    try:
        outcome = _run_waiting_out_restarts(ctx, job_id, start, end)
    except JobNotFound as exc:
        # A message for a job this store lacks (planted, or a worker pointed at another database) fails alone;
        # the store answered, so the worker carries on. A worker on the right store re-enqueues real work.
        raise UnknownJob(f"{exc}; is this worker's --db the one `submit` used?") from None
    except StoreError as exc:
        timeout = _shard_timeout(exc)
        if timeout is not None:  # the shard's time ran out during a store call: the store itself is fine
            raise timeout from None
        # Nothing finished is lost (each result was committed or the write failed before it counted);
        # RQ retries the shard later, on this or another worker.
        ctx.fatal = str(exc)
        log.error("store failed, stopping this worker: %s", exc)
        raise
    finally:
        ctx.current = None
    talk.finished(outcome)
    ctx.shards_done += 1
    ctx.requests_ended += outcome.completed + outcome.failed
    if not outcome.stopped:
        ctx.last_shard = (job_id, start)
    if outcome.stopped and ctx.redis is not None and ctx.queue is not None:
        back = Shard(job_id, start, end, suffix=f"-h{uuid.uuid4().hex[:8]}")
        timeout = shard_timeout_of(ctx.store.get_job(job_id))
        enqueue_shards(ctx.redis, ctx.queue, [back], at_front=True, timeout=timeout)
        left = ctx.store.count_pending(job_id, start, end)  # the unread rows too, not only those in flight
        ctx.handed_back += left
        talk.handed_back(left, back.rq_id)
    return outcome.to_dict()


def _run_waiting_out_restarts(ctx: WorkerContext, job_id: str, start: int, end: int) -> shard.ShardOutcome:
    """shard.run_shard; when the database goes away (a restart), wait until it answers and run the shard again
    (reconnect.py). Gives up (raises) when the worker is stopping or after reconnect.RERUNS tries."""
    for tries in range(reconnect.RERUNS + 1):
        try:
            return shard.run_shard(
                ctx.store, ctx.engine, job_id, start, end, control=ctx.control, worker=ctx.name, meter=ctx.meter
            )
        except StoreUnavailable as exc:
            if _shard_timeout(exc) is not None or tries == reconnect.RERUNS:
                raise
            log.warning("shard %s[%s:%s]: the database went away (%s); waiting for it", job_id, start, end, exc)
            if not reconnect.await_store(ctx.store, lambda: ctx.stopping):
                raise
            ctx.engine.reset()  # what was in flight is run again from the store: start from a clean engine
            log.info("shard %s[%s:%s]: the database is back; running the shard again", job_id, start, end)
    raise AssertionError("unreachable")


def _shard_timeout(exc: BaseException) -> BaseException | None:
    """The shard-timeout exception (RQ raises it from a signal, anywhere) that caused `exc`, if any."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, JobTimeoutException):
            return seen
        seen = seen.__cause__ or seen.__context__ or getattr(seen, "orig", None)
    return None
