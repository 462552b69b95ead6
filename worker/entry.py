"""The RQ entry point of a shard, and the worker process's context (store, engine, stop flags).

RQ calls `run_shard` with JSON arguments; the model stays loaded in this process between shards.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from redis import Redis

from omlx_jobs import defaults
from omlx_jobs.errors import OmlxError
from omlx_jobs.jobs.actions import shard_timeout_of
from omlx_jobs.jobs.images import ImageAccess
from omlx_jobs.jobs.queue import Shard, enqueue_shards
from omlx_jobs.store import Store, StoreError
from omlx_jobs.store.db import JobNotFound
from omlx_jobs.worker import shard
from omlx_jobs.worker.engine import Control, Engine

log = logging.getLogger(__name__)

DEFAULT_DRAIN_TIMEOUT = defaults.DRAIN_TIMEOUT


class UnknownJob(OmlxError, LookupError):
    """A shard message names a job that is not in this worker's store."""


@dataclass
class WorkerContext:
    store: Store
    engine: Engine
    redis: Redis | None = None
    queue: str | None = None
    drain_timeout: float = DEFAULT_DRAIN_TIMEOUT
    images: ImageAccess = field(default_factory=ImageAccess)
    """Where images in messages may come from on this worker (--allow-files-from, --allow-remote-images); the
    worker checks every image again against it, whatever submit allowed."""
    fatal: str | None = None
    """Set when the store fails (disk full, read-only): the worker stops taking work."""
    name: str | None = None
    """The RQ worker's name: recorded with every shard run (status --json lists who ran a job)."""
    model_name: str | None = None
    """The model's short name for `omlx-jobs workers` and the page (--model-name; default: derived)."""
    current: tuple[str, int, int] | None = None
    """The shard running now (job id, first, end position): `omlx-jobs workers` shows it."""
    last_shard: tuple[str, int] | None = None
    on_shard: Callable[[], None] | None = field(default=None, repr=False)
    """Called when a shard starts (the RQ worker publishes its record then)."""
    """The shard finished last (job id, first position): its prefix group is in this worker's cache."""
    requests_done: int = 0
    _drain_deadline: float | None = field(default=None, repr=False)
    _stop: bool = field(default=False, repr=False)

    def request_drain(self) -> None:
        """Stop admitting; in-flight requests get drain_timeout seconds to finish, the rest go back to the queue."""
        if self._drain_deadline is None:
            self._drain_deadline = time.monotonic() + self.drain_timeout

    def request_stop(self) -> None:
        self._stop = True

    @property
    def stopping(self) -> bool:
        return self._stop or self._drain_deadline is not None

    def meter(self, requests: int, tokens: int) -> None:
        """Count committed results (tokens per second come from the engine's live counters, jobs/live.py)."""
        self.requests_done += requests

    def control(self) -> Control:
        if self._stop:
            return Control.STOP
        if self._drain_deadline is not None:
            return Control.DRAIN if time.monotonic() < self._drain_deadline else Control.STOP
        return Control.RUN


_context: WorkerContext | None = None


def install(context: WorkerContext | None) -> None:
    global _context
    _context = context


def current() -> WorkerContext:
    if _context is None:
        raise RuntimeError("run_shard runs inside `omlx-jobs worker`, which loads the model first")
    return _context


def run_shard(job_id: Any, start: Any, end: Any) -> dict[str, Any]:
    """Run one shard of a job; hands unfinished requests back to the queue if the worker is stopping."""
    if not isinstance(job_id, str) or not all(isinstance(x, int) and not isinstance(x, bool) for x in (start, end)):
        raise ValueError(f"bad shard message: ({job_id!r}, {start!r}, {end!r})")
    ctx = current()
    ctx.current = (job_id, start, end)
    if ctx.on_shard is not None:
        ctx.on_shard()  # `omlx-jobs workers` shows the shard now, not at the next heartbeat
    try:
        outcome = shard.run_shard(
            ctx.store, ctx.engine, job_id, start, end, control=ctx.control, worker=ctx.name, meter=ctx.meter
        )
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
    if not outcome.stopped:
        ctx.last_shard = (job_id, start)
    if outcome.stopped and ctx.redis is not None and ctx.queue is not None:
        back = Shard(job_id, start, end, suffix=f"-h{uuid.uuid4().hex[:8]}")
        timeout = shard_timeout_of(ctx.store.get_job(job_id))
        enqueue_shards(ctx.redis, ctx.queue, [back], at_front=True, timeout=timeout)
        log.info("handed %s requests of %s back to the queue as %s", outcome.left_pending, job_id, back.rq_id)
    return outcome.to_dict()


def _shard_timeout(exc: BaseException) -> BaseException | None:
    """The shard-timeout exception (RQ raises it from a signal, anywhere) that caused `exc`, if any."""
    from rq.timeouts import JobTimeoutException

    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, JobTimeoutException):
            return seen
        seen = seen.__cause__ or seen.__context__ or getattr(seen, "orig", None)
    return None
