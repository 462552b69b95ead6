"""The long-lived RQ worker: one process, model loaded once, shards run in-process (no fork per job).

Safety: payloads are read with RQ's JSON serializer only, and only the shard entry point may run.
Liveness: a heartbeat thread keeps a running shard's registry entry alive (--heartbeat-ttl); when a worker
dies, the entry expires and any idle worker's maintenance (every min(TTL, 30) s) retries the shard.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from typing import Any

from redis.exceptions import RedisError
from rq.exceptions import NoSuchJobError, StopRequested
from rq.job import Job
from rq.queue import Queue
from rq.registry import FailedJobRegistry, StartedJobRegistry
from rq.serializers import JSONSerializer
from rq.worker import SimpleWorker, WorkerStatus

from omlx_jobs import defaults
from omlx_jobs.errors import OmlxError
from omlx_jobs.jobs import actions, affinity
from omlx_jobs.jobs import workers as live
from omlx_jobs.jobs.live import RateMeter, counters_of
from omlx_jobs.jobs.model_names import display_name
from omlx_jobs.jobs.queue import SHARD_FUNC, get_queue, worker_queues
from omlx_jobs.store import StoreError, StoreUnavailable
from omlx_jobs.worker.runtime import report
from omlx_jobs.worker.runtime.context import WorkerContext
from omlx_jobs.worker.runtime.reconnects import quiet_reconnects, reached

log = logging.getLogger(__name__)

DEFAULT_HEARTBEAT_TTL = defaults.HEARTBEAT_TTL
"""A running shard's registry entry lives this long without a heartbeat; beats come every TTL/4 seconds.
A dead worker's shard is queued again within TTL + min(TTL, 30) seconds by any idle worker's maintenance."""


class RefusedPayload(OmlxError, RuntimeError):
    """A queued message that is not a shard of ours (another function, or not JSON): never run."""


class OmlxWorker(SimpleWorker):
    """SimpleWorker (in-process) with heartbeats, drain on SIGTERM and a JSON-only, single-entry-point policy."""

    def __init__(
        self, queues: list[Queue], *, context: WorkerContext, heartbeat_ttl: int = DEFAULT_HEARTBEAT_TTL, **kwargs: Any
    ) -> None:
        self.heartbeat_ttl = max(2, int(heartbeat_ttl))
        self.heartbeat_interval = max(0.5, self.heartbeat_ttl / 4)
        kwargs["serializer"] = JSONSerializer  # never pickle: a Redis writer must not run code here
        kwargs.setdefault("job_monitoring_interval", max(1, int(self.heartbeat_interval)))
        kwargs.setdefault("maintenance_interval", min(30, self.heartbeat_ttl))
        super().__init__(queues, **kwargs)
        self.context = context
        context.name = self.name
        context.on_shard = self.publish
        self._born = time.time()
        self.rates = RateMeter()
        self.busy = report.BusyTalk()

    def heartbeat(self, timeout: int | None = None, pipeline: Any = None) -> Any:
        result = super().heartbeat(timeout, pipeline)
        reached(self.context.redis_state)
        self.publish()
        return result

    def unsubscribe(self) -> None:
        """RQ's, but UNSUBSCRIBE only while subscribed. After a Redis restart the pubsub may not be subscribed yet,
        and then redis-py sends the command after a health check that waits on the socket with no timeout: a
        SIGTERM'd worker hung there (tests/test_faults.py). Unsubscribed, its thread stops by itself."""
        thread, pubsub = self.pubsub_thread, self.pubsub
        if thread:
            log.info("unsubscribing from channel %s", self.pubsub_channel_name)
            if pubsub.subscribed:
                pubsub.unsubscribe()
            thread.stop()
            thread.join(timeout=1)
            with contextlib.suppress(Exception):
                pubsub.close()

    def publish(self) -> None:
        """Refresh this worker's record for `omlx-jobs workers` (jobs/workers.py); never fails the loop."""
        ctx = self.context
        job_id, first, end = ctx.current or (None, None, None)
        rates = self.rates.sample(counters_of(ctx.engine), busy=job_id is not None)
        info = live.WorkerInfo(
            name=self.name,
            model=ctx.engine.loaded.ref,
            model_name=display_name(ctx.engine.loaded.ref, ctx.model_name),
            queues=[q.name for q in self.queues],
            host=socket.gethostname(),
            pid=os.getpid(),
            state="draining" if ctx.stopping else ("busy" if job_id else "idle"),
            job_id=job_id,
            shard=f"{first}-{end}" if job_id else None,
            tokens_per_second=rates.generated_tokens_per_second,
            prompt_tokens_per_second=rates.prompt_tokens_per_second,
            in_flight=rates.in_flight,
            generated_tokens=rates.generated_tokens,
            prefilled_tokens=rates.prefilled_tokens,
            requests_done=ctx.requests_done,
            started_at=self._born,
        )
        try:  # a beat comes at least every dequeue timeout (idle) or heartbeat interval (busy)
            live.publish(self.connection, info, ttl=self.dequeue_timeout + self.heartbeat_ttl + 5)
        except RedisError as exc:
            log.debug("could not publish the worker record: %s", exc)

    def dequeue_job_and_maintain_ttl(self, timeout: int | None, max_idle_time: int | None = None) -> Any:
        claimed = self._claim_same_group()
        if claimed is not None:
            return claimed
        return super().dequeue_job_and_maintain_ttl(timeout, max_idle_time)

    def _claim_same_group(self) -> tuple[Job, Queue] | None:
        """After a shard, its prefix group's next queued shard, before anything else (jobs/affinity.py)."""
        last, self.context.last_shard = self.context.last_shard, None
        if last is None or self.context.stopping:
            return None
        try:
            names = [q.name for q in self.queues]
            claimed = affinity.claim_same_group(self.connection, self.context.store, names, *last)
            if claimed is None:
                return None
            rq_id, queue_name = claimed
            queue = self.queues[names.index(queue_name)]
            job = Job.fetch(rq_id, connection=self.connection, serializer=JSONSerializer)
        except NoSuchJobError:
            return None
        except StopRequested:  # SIGTERM while idle (RQ's handler raises it here): a stop, not a failed claim
            raise
        except Exception:  # the preference is an optimisation: on any trouble, dequeue as RQ does
            log.exception("taking a shard of the same prefix group failed")
            return None
        job.redis_server_version = self.get_redis_server_version()
        self.log.info("Worker %s: %s: %s (%s) [same prefix group]", self.name, queue.name, job.description, job.id)
        return job, queue

    def get_heartbeat_ttl(self, job: Job, working_time: float = 0.0) -> int:
        return self.heartbeat_ttl

    @property
    def dequeue_timeout(self) -> int:
        # Wake up often enough to run maintenance (requeue abandoned shards) on time.
        return max(1, min(super().dequeue_timeout, int(self.maintenance_interval)))

    def run_maintenance_tasks(self) -> None:
        super().run_maintenance_tasks()
        # Redis holds only messages; the store knows which jobs still have pending requests. Re-enqueue those
        # whose shard is gone (a Redis restart without persistence, retries exhausted, a lost hand-back).
        for queue in self.queues:
            try:
                # The grace lets running workers re-claim their shards after a Redis restart (one beat).
                done = actions.reconcile(self.context.store, self.connection, queue.name, grace=self.heartbeat_ttl / 2)
                for job_id in done.requeued:
                    log.warning("job %s had pending requests but no shard in Redis; enqueued it again", job_id)
            except StopRequested:  # SIGTERM while idle: RQ's handler raises this wherever the loop is
                raise
            except Exception:
                log.exception("reconciling queue %s with the store failed", queue.name)

    def execute_job(self, job: Job, queue: Queue) -> None:
        try:
            func_name = job.func_name
            if func_name != SHARD_FUNC:
                raise RefusedPayload(f"refusing job {job.id}: it calls {func_name!r}, not {SHARD_FUNC}")
        except StopRequested:  # SIGTERM before the shard started: maintenance (RQ cleanup, reconcile) requeues it
            raise
        except Exception as exc:  # not JSON, or another function: never run it
            log.error("refusing job %s: %s", job.id, exc)
            self._refuse(job, queue, str(exc))
            return
        execution = self.prepare_execution(job)
        stop = threading.Event()
        args = (job, queue, execution, stop)
        beat = threading.Thread(target=self._beat, args=args, daemon=True, name="omlx-heartbeat")
        beat.start()
        try:
            self.perform_job(job, queue, execution)
        finally:
            stop.set()
            beat.join(timeout=5)
            self.busy.idle()
        if self.context.fatal:
            self._stop_requested = True  # the store failed: take no more work rather than lose results
        self.set_state(WorkerStatus.IDLE)

    def _refuse(self, job: Job, queue: Queue, reason: str) -> None:
        try:
            FailedJobRegistry(queue=queue).add(job, exc_string=f"refused: {reason}")
        except Exception:
            self.connection.zadd(FailedJobRegistry(queue=queue).key, {job.id: 0})
        self.connection.lrem(queue.intermediate_queue_key, 1, job.id)  # taken, never started: not in flight
        self.set_state(WorkerStatus.IDLE)

    def _beat(self, job: Job, queue: Queue, execution: Any, stop: threading.Event) -> None:
        while not stop.wait(min(self.heartbeat_interval, defaults.LIVE_TICK_SECONDS)):  # live figures every few seconds
            ctx = self.context
            with contextlib.suppress(Exception):  # the minute line is advisory; it never stops the beat
                busy_on = ctx.current[0] if ctx.current else None
                self.busy.maybe(busy_on, self.rates.sample(counters_of(ctx.engine)), ctx.engine.cache.stats)
            try:
                self.maintain_heartbeats(job, execution)
                reached(ctx.redis_state)
                if not stop.is_set():
                    # After a Redis restart the registry is empty: claim the running shard again, so that
                    # reconcile does not hand its range to another worker while it runs here.
                    queue.started_job_registry.add_execution(execution, self.connection, ttl=self.heartbeat_ttl)
            except RedisError as exc:  # Redis restarting: results go to the store; keep beating
                log.warning("heartbeat failed (%s); retrying", exc)
            except Exception:
                log.exception("heartbeat failed")

    def handle_warm_shutdown_request(self) -> None:
        log.warning("stop requested: no new requests; in-flight ones get %ss to finish", self.context.drain_timeout)
        self.context.request_drain()

    def request_force_stop(self, signum: int, frame: Any) -> None:
        if self.get_state() == WorkerStatus.BUSY:
            log.warning("second stop request: stopping now; unfinished requests go back to the queue")
            self.context.request_stop()
            return
        super().request_force_stop(signum, frame)


def serve(
    context: WorkerContext,
    queue_name: str,
    *,
    burst: bool = False,
    heartbeat_ttl: int = DEFAULT_HEARTBEAT_TTL,
    name: str | None = None,
    max_wait: float = 30.0,
) -> int:
    """Run the worker until stopped (or, with burst, until the queue is empty). Returns an exit code.

    RQ's work loop quits on a Redis error; the model stays loaded here, so this waits for Redis with
    backoff and starts a new work loop. Jobs whose shards Redis lost are re-enqueued by maintenance.
    """
    with quiet_reconnects(context.redis_state):
        code = _serve(context, queue_name, burst, heartbeat_ttl, name, max_wait)
    if code == 3:
        reason = "the store failed"
    elif context.stopping or not burst:
        reason = "stop requested"
    else:
        reason = "--burst, and no work is left on its queues"
    report.log.info(report.stop_line(reason, context.handed_back, context.shards_done, context.requests_ended))
    return code


def _serve(
    context: WorkerContext, queue_name: str, burst: bool, heartbeat_ttl: int, name: str | None, max_wait: float
) -> int:
    redis = context.redis
    assert redis is not None
    delay = 1.0
    while True:
        worker = None
        try:
            # Building the worker talks to Redis too (CLIENT SETNAME), so it sits inside the retry loop.
            queues = [get_queue(redis, q) for q in worker_queues(queue_name, context.engine.loaded.ref)]
            worker = OmlxWorker(queues, connection=redis, context=context, heartbeat_ttl=heartbeat_ttl, name=name)
            worker.work(burst=burst, logging_level=logging.getLevelName(log.getEffectiveLevel()))
        except RedisError as exc:
            log.warning("Redis error: %s", exc)
        except StopRequested:  # a signal between work loops, handled by the last loop's handler
            pass
        finally:
            if worker is not None:
                _release(worker)
                with contextlib.suppress(RedisError):
                    live.retire(redis, worker.name)
        if context.fatal:
            log.error("stopped: %s", context.fatal)
            return 3
        if (worker is not None and worker._stop_requested) or context.stopping:
            return 0
        code, delay = _between_loops(context, queue_name, burst, heartbeat_ttl, delay, max_wait)
        if code is not None:
            return code
        if context.stopping:
            return 0
        name = None  # a new registration: the old one may linger until it expires


def _between_loops(
    context: WorkerContext, queue_name: str, burst: bool, heartbeat_ttl: int, delay: float, max_wait: float
) -> tuple[int | None, float]:
    """After a work loop ended: the exit code if the worker should stop (burst and nothing left, a stop signal,
    the store gone), else None and the next backoff, having waited (1 s, or the backoff while Redis is down)."""
    redis = context.redis
    pause = 1.0  # a shard still runs elsewhere (burst), or the loop quit on an error: not a busy loop
    try:
        redis.ping()
        reached(context.redis_state)
        if burst and all(
            _nothing_left(context, redis, q, grace=heartbeat_ttl / 2)
            for q in worker_queues(queue_name, context.engine.loaded.ref)
        ):
            return 0, delay
        delay = 1.0
    except RedisError as exc:
        log.warning("Redis unreachable (%s); retrying in %.0fs", exc, delay)
        pause, delay = delay, min(delay * 2, max_wait)
    except StopRequested:
        return 0, delay
    except StoreUnavailable as exc:  # a database restart: wait it out, as for Redis (runtime/reconnect.py)
        log.warning("the database is unreachable (%s); retrying in %.0fs", exc, delay)
        pause, delay = delay, min(delay * 2, max_wait)
    except StoreError as exc:
        log.error("stopped: %s", exc)
        return 3, delay
    try:  # outside the handlers above: a signal while waiting for Redis is a clean stop too
        time.sleep(pause)
    except StopRequested:
        return 0, delay
    return None, delay


def _release(worker: OmlxWorker) -> None:
    """Stop the pubsub thread of a work loop that ended on a Redis error (its teardown did not get that far)."""
    thread = getattr(worker, "pubsub_thread", None)
    if thread is not None and thread.is_alive():
        thread.stop()


def _nothing_left(context: WorkerContext, redis: Any, queue_name: str, grace: float) -> bool:
    """Burst mode ends when no shard waits or runs, and the store holds no work whose shard Redis lost
    (a shard failed for good, a lost hand-back): reconcile enqueues that, and the worker runs it."""
    queue = get_queue(redis, queue_name)
    # The registry first: counting it requeues abandoned shards, which the queue count must then see. A shard
    # in the intermediate list (its worker died while taking it) goes back to the queue after a minute.
    if StartedJobRegistry(queue=queue).count or queue.count or redis.llen(queue.intermediate_queue_key):
        return False
    done = actions.reconcile(context.store, redis, queue_name, grace=grace)
    return not done.requeued and not done.deferred
