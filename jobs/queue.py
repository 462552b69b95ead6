"""Redis/RQ side of a job: connections, one queue per model, shard messages (JSON only, never pickle)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from redis import Redis
from redis.exceptions import RedisError
from rq import Queue, Retry
from rq.serializers import JSONSerializer

from omlx_jobs import defaults
from omlx_jobs.errors import OmlxError
from omlx_jobs.jobs.model_names import model_key

DEFAULT_REDIS_URL = defaults.REDIS_URL
SHARD_FUNC = "omlx_jobs.worker.entry.run_shard"
QUEUE_PREFIX = "omlx:"
DEFAULT_SHARD_TIMEOUT = defaults.SHARD_TIMEOUT
SHARD_RETRIES = 3


class RedisUnavailable(OmlxError, RuntimeError):
    """Redis cannot be reached; the message says which URL and what to do."""


@dataclass(frozen=True)
class Shard:
    """A message: a job and a range [start, end) of its request positions."""

    job_id: str
    start: int
    end: int

    suffix: str = ""

    @property
    def rq_id(self) -> str:
        return f"{self.job_id}--{self.start}-{self.end}{self.suffix}"


def resolve_redis_url(explicit: str | None = None) -> str:
    return explicit or os.environ.get("OMLX_JOBS_REDIS_URL") or DEFAULT_REDIS_URL


def safe_url(url: str) -> str:
    """The URL with any password masked, for messages."""
    if "@" not in url or "://" not in url:
        return url
    scheme, rest = url.split("://", 1)
    creds, host = rest.rsplit("@", 1)
    user = creds.split(":", 1)[0] if ":" in creds else ""
    return f"{scheme}://{user}:***@{host}"


def connect(url: str | None = None, *, check: bool = True) -> Redis:
    """A Redis client for `url` (redis://, rediss:// with TLS, passwords in the URL). Pings unless check=False."""
    url = resolve_redis_url(url)
    try:
        conn = Redis.from_url(url, socket_connect_timeout=5, socket_timeout=30, health_check_interval=30)
        if check:
            conn.ping()
    except (RedisError, ValueError, OSError) as exc:
        raise RedisUnavailable(
            f"cannot reach Redis at {safe_url(url)} ({exc}). Start it (e.g. `redis-server --daemonize yes`), "
            "or point --redis-url / OMLX_JOBS_REDIS_URL at a running server. "
            "`omlx-jobs run` works without Redis."
        ) from exc
    return conn


PRIORITIES = ("high", "normal", "low")
"""Submit's --priority. A worker listens on all three queues of its model and takes the highest first."""


def queue_name(model: str, priority: str = "normal") -> str:
    """Workers serving `model` listen on this queue: `omlx:<key>`, the key a hash of the resolved model
    (jobs/model_names.py), so that two spellings of one model meet on one queue."""
    return with_priority(f"{QUEUE_PREFIX}{model_key(model)}", priority)


def legacy_queue_name(model: str) -> str:
    """The queue of `model` before queues were keyed (`omlx:<model as spelled>`): jobs queued then wait on it."""
    return f"{QUEUE_PREFIX}{model}"


def worker_queues(base: str, model: str) -> list[str]:
    """The queues a worker of `model` on queue `base` listens on, highest priority first: base's three, and
    when base is the model's keyed queue, the three queues its own spelling had before, each after its peer."""
    queues = priority_queues(base)
    legacy = legacy_queue_name(model)
    if base != queue_name(model) or legacy == base:
        return queues
    return [q for pair in zip(queues, priority_queues(legacy), strict=True) for q in pair]


def with_priority(base: str, priority: str) -> str:
    """The queue of `priority` for a base queue name: the base itself for normal, base:high, base:low."""
    if priority not in PRIORITIES:
        raise ValueError(f"unknown priority {priority!r}; use one of {', '.join(PRIORITIES)}")
    return base if priority == "normal" else f"{base}:{priority}"


def priority_queues(base: str) -> list[str]:
    """The queues a worker of `base` serves, highest priority first (RQ dequeues in this order)."""
    return [with_priority(base, p) for p in PRIORITIES]


def get_queue(conn: Redis, name: str) -> Queue:
    return Queue(name, connection=conn, serializer=JSONSerializer)


def enqueue_shards(
    conn: Redis,
    queue: str,
    shards: list[Shard],
    *,
    timeout: int = DEFAULT_SHARD_TIMEOUT,
    at_front: bool = False,
) -> list[str]:
    """Put shard messages on the queue; returns their RQ job ids.

    A shard's requests that already have a result are skipped when it runs, so enqueueing one twice is safe.
    A failed shard (engine error, lost worker) is retried right away, up to SHARD_RETRIES times.
    """
    q = get_queue(conn, queue)
    ids = []
    try:
        for shard in shards:
            job = q.enqueue_call(
                SHARD_FUNC,
                args=(shard.job_id, shard.start, shard.end),
                job_id=shard.rq_id,
                timeout=timeout,
                result_ttl=24 * 3600,
                failure_ttl=7 * 24 * 3600,
                retry=Retry(max=SHARD_RETRIES),
                at_front=at_front,
                description=f"omlx-jobs shard {shard.rq_id}",
            )
            ids.append(job.id)
    except RedisError as exc:
        raise RedisUnavailable(f"Redis failed while enqueueing shards ({exc})") from exc
    return ids


def cancel_queued(conn: Redis, queue: str, job_id: str) -> tuple[int, int]:
    """Drop this job's shards that wait in the queue; returns (dropped, running)."""
    from rq.job import Job as RQJob
    from rq.registry import StartedJobRegistry

    q = get_queue(conn, queue)
    dropped = 0
    for rq_id in q.get_job_ids():
        if rq_id.startswith(f"{job_id}--"):
            try:
                RQJob.fetch(rq_id, connection=conn, serializer=JSONSerializer).cancel()
            except Exception:
                q.remove(rq_id)
            dropped += 1
    started = StartedJobRegistry(queue=q)
    running = sum(1 for rq_id in started.get_job_ids() if rq_id.startswith(f"{job_id}--"))
    return dropped, running
