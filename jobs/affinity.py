"""Prefix affinity through RQ: after a shard, a worker takes a queued shard of the same prefix group.

Its cache holds that group's prefix, so another worker would compute it again. There is no scheduler of our
own: the shard's id is taken out of RQ's queue list with LREM, which removes it for exactly one caller, and
the worker then runs it as RQ would have. Higher-priority work still comes first.
"""

from __future__ import annotations

from redis import Redis

from omlx_jobs.jobs.actions import shard_base_id
from omlx_jobs.jobs.queue import Shard, get_queue
from omlx_jobs.store import Store


def claim_same_group(
    redis: Redis, store: Store, queues: list[str], job_id: str, first_pos: int
) -> tuple[str, str] | None:
    """Take a queued shard that continues the prefix group the shard at `first_pos` of `job_id` ended with.

    `queues` are the worker's queues, highest priority first. Returns (RQ id, queue name) of the shard it
    took, or None: no such shard waits, a higher-priority queue has work, or another worker took it first.
    """
    shard = store.get_shard(job_id, first_pos)
    job = store.get_job(job_id)
    if shard is None or job.queue not in queues:
        return None
    higher = queues[: queues.index(job.queue)]
    if any(redis.llen(get_queue(redis, q).key) for q in higher):
        return None
    wanted = {
        Shard(job_id, s.first_pos, s.end_pos).rq_id
        for s in store.shards(job_id, pending_only=True, group=shard.group_last)
        if s.first_pos != first_pos
    }
    if not wanted:
        return None
    key = get_queue(redis, job.queue).key
    for raw in redis.lrange(key, 0, -1):
        rq_id = raw.decode() if isinstance(raw, bytes) else raw
        if shard_base_id(rq_id) in wanted and redis.lrem(key, 1, rq_id) == 1:
            return rq_id, job.queue
    return None
