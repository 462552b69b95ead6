"""Live workers, as Redis knows them: each worker refreshes a small record with its heartbeat. No MLX.

The CLI (`omlx-jobs workers`, `status`) and the HTTP server read it with `list_workers`; the worker writes it
with `publish`. A record expires a little after its worker's heartbeats stop, so a killed worker drops out.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

from redis import Redis

from omlx_jobs.jobs.model_names import display_name

WORKERS_SET = "omlx:workers"
WORKER_KEY = "omlx:worker:"


@dataclass
class WorkerInfo:
    """One worker: what it serves, what it runs now and how fast, and when it last said so."""

    name: str
    model: str
    """The model as the worker's --model spelled it (a path, a repo id): shown in details only."""
    queues: list[str] = field(default_factory=list)
    host: str = ""
    pid: int = 0
    state: str = "idle"
    """idle, busy (running a shard) or draining (stopping after its in-flight requests)."""
    job_id: str | None = None
    shard: str | None = None
    """The running shard as FIRST-END positions of the job's prefix order."""
    tokens_per_second: float = 0.0
    """Generated tokens per second now (its engine's counters over the last ~20 s, jobs/live.py)."""
    prompt_tokens_per_second: float = 0.0
    """Prompt tokens computed (prefilled) per second now, the cached ones not counted."""
    in_flight: int = 0
    """Requests in its engine now: admitted, not finished."""
    generated_tokens: int = 0
    prefilled_tokens: int = 0
    """Its engine's totals since it started."""
    model_name: str = ""
    """The model's short name (jobs/model_names.py); empty in records of older workers (derived then)."""
    requests_done: int = 0
    started_at: float = 0.0
    last_heartbeat: float = 0.0

    def __post_init__(self) -> None:
        if not self.model_name:
            self.model_name = display_name(self.model)

    def serves(self, queue: str) -> bool:
        return queue in self.queues

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def publish(redis: Redis, info: WorkerInfo, ttl: float) -> None:
    """Write (or refresh) this worker's record; it lives `ttl` seconds unless refreshed."""
    info.last_heartbeat = time.time()
    with redis.pipeline(transaction=False) as pipe:
        pipe.set(WORKER_KEY + info.name, json.dumps(info.to_dict()), ex=max(1, int(ttl)))
        pipe.sadd(WORKERS_SET, info.name)
        pipe.execute()


def retire(redis: Redis, name: str) -> None:
    """Remove a worker's record (a clean exit; a killed worker's record expires by itself)."""
    with redis.pipeline(transaction=False) as pipe:
        pipe.delete(WORKER_KEY + name)
        pipe.srem(WORKERS_SET, name)
        pipe.execute()


def list_workers(redis: Redis) -> list[WorkerInfo]:
    """Every live worker, by model then name; records that expired are dropped from the set here."""
    names = sorted(n.decode() if isinstance(n, bytes) else n for n in redis.smembers(WORKERS_SET))
    if not names:
        return []
    records = redis.mget([WORKER_KEY + n for n in names])
    gone = [n for n, r in zip(names, records, strict=True) if r is None]
    if gone:
        redis.srem(WORKERS_SET, *gone)
    workers = [_parse(r) for r in records if r is not None]
    return sorted((w for w in workers if w is not None), key=lambda w: (w.model, w.name))


def serving(workers: Iterable[WorkerInfo], queue: str) -> list[WorkerInfo]:
    """The workers that listen on `queue`."""
    return [w for w in workers if w.serves(queue)]


def served_models(redis: Redis) -> dict[str, str]:
    """What live workers serve, by the names a batch may give: each worker's model string and its short name,
    to the model string (the first worker's, by name, when two spell one name differently)."""
    served: dict[str, str] = {}
    for w in sorted(list_workers(redis), key=lambda w: w.name):
        served.setdefault(w.model, w.model)
        served.setdefault(w.model_name, w.model)
    return served


def _parse(raw: bytes | str) -> WorkerInfo | None:
    try:
        data = json.loads(raw)
        known = {k: v for k, v in data.items() if k in WorkerInfo.__dataclass_fields__}
        return WorkerInfo(**known)
    except (ValueError, TypeError):  # a record written by another version, or not by us: skip it
        return None
