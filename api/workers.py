"""Live workers as RQ's worker registry sees them: name, state, queues, current shard, last heartbeat.

One small function, so that `omlx-jobs workers`' own listing (issue 10) can replace it later.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from redis import Redis

from omlx_jobs.jobs.queue import QUEUE_PREFIX

PRIORITY_SUFFIXES = (":high", ":normal", ":low")


@dataclass(frozen=True)
class WorkerView:
    name: str
    state: str
    queues: list[str]
    models: list[str]
    current_shard: str | None
    """The RQ id of the shard it runs: `<job id>--<start>-<end>[suffix]`."""
    current_job: str | None
    last_heartbeat: float | None
    started_at: float | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def model_of_queue(queue: str) -> str | None:
    """The model a queue `omlx:<model>[:priority]` serves, or None for a queue that is not ours."""
    if not queue.startswith(QUEUE_PREFIX):
        return None
    model = queue[len(QUEUE_PREFIX) :]
    for suffix in PRIORITY_SUFFIXES:
        model = model.removesuffix(suffix)
    return model or None


def list_workers(redis: Redis) -> list[WorkerView]:
    """Every worker registered in Redis (RQ drops one whose key expired, so these are alive), by name."""
    from rq import Worker
    from rq.serializers import JSONSerializer

    out = []
    for w in Worker.all(connection=redis, serializer=JSONSerializer):
        queues = w.queue_names()
        shard = w.get_current_job_id()
        out.append(
            WorkerView(
                name=w.name,
                state=str(w.get_state()),
                queues=queues,
                models=sorted({m for q in queues if (m := model_of_queue(q))}),
                current_shard=shard,
                current_job=shard.split("--", 1)[0] if shard else None,
                last_heartbeat=w.last_heartbeat.timestamp() if w.last_heartbeat else None,
                started_at=w.birth_date.timestamp() if w.birth_date else None,
            )
        )
    return sorted(out, key=lambda v: v.name)


def served_models(redis: Redis) -> set[str]:
    """The models that live workers serve."""
    return {m for w in list_workers(redis) for m in w.models}
