"""The long-lived RQ worker: one process, model loaded once, shards run in-process (no fork per job).

Safety: payloads are read with RQ's JSON serializer only, and only the shard entry point may run.
Liveness: a heartbeat thread keeps a running shard's registry entry alive (TTL HEARTBEAT_TTL); when a
worker dies, the entry expires and any worker's maintenance (every MAINTENANCE_INTERVAL) retries the shard.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from redis.exceptions import RedisError
from rq.job import Job
from rq.queue import Queue
from rq.serializers import JSONSerializer
from rq.worker import SimpleWorker, WorkerStatus

from omlx_jobs.jobs.queue import SHARD_FUNC
from omlx_jobs.worker.entry import WorkerContext

log = logging.getLogger(__name__)

HEARTBEAT_INTERVAL = 10
HEARTBEAT_TTL = 45
MAINTENANCE_INTERVAL = 30
ABANDONED_AFTER = HEARTBEAT_TTL + MAINTENANCE_INTERVAL
"""Upper bound, in seconds, before a dead worker's shard is queued again (while some worker is idle)."""


class RefusedPayload(RuntimeError):
    pass


class OmlxWorker(SimpleWorker):
    """SimpleWorker (in-process) with heartbeats, drain on SIGTERM and a JSON-only, single-entry-point policy."""

    def __init__(self, queues: list[Queue], *, context: WorkerContext, **kwargs: Any) -> None:
        kwargs.setdefault("serializer", JSONSerializer)
        kwargs.setdefault("job_monitoring_interval", HEARTBEAT_INTERVAL)
        kwargs.setdefault("maintenance_interval", MAINTENANCE_INTERVAL)
        super().__init__(queues, **kwargs)
        self.context = context

    def get_heartbeat_ttl(self, job: Job, working_time: float = 0.0) -> int:
        return HEARTBEAT_TTL

    def execute_job(self, job: Job, queue: Queue) -> None:
        try:
            func_name = job.func_name
            if func_name != SHARD_FUNC:
                raise RefusedPayload(f"refusing job {job.id}: it calls {func_name!r}, not {SHARD_FUNC}")
        except Exception as exc:  # not JSON, or another function: never run it
            log.error("refusing job %s: %s", job.id, exc)
            self._refuse(job, queue, str(exc))
            return
        execution = self.prepare_execution(job)
        stop = threading.Event()
        beat = threading.Thread(target=self._beat, args=(job, execution, stop), daemon=True, name="omlx-heartbeat")
        beat.start()
        try:
            self.perform_job(job, queue, execution)
        finally:
            stop.set()
            beat.join(timeout=5)
        self.set_state(WorkerStatus.IDLE)

    def _refuse(self, job: Job, queue: Queue, reason: str) -> None:
        from rq.registry import FailedJobRegistry

        try:
            FailedJobRegistry(queue=queue).add(job, exc_string=f"refused: {reason}")
        except Exception:
            self.connection.zadd(FailedJobRegistry(queue=queue).key, {job.id: 0})
        self.set_state(WorkerStatus.IDLE)

    def _beat(self, job: Job, execution: Any, stop: threading.Event) -> None:
        while not stop.wait(HEARTBEAT_INTERVAL):
            try:
                self.maintain_heartbeats(job, execution)
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
