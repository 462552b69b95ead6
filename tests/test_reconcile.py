"""reconcile on a real Redis: a shard popped by a worker but not yet registered is not handed out again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from redis import Redis

from omlx_jobs.jobs import actions, lifecycle
from omlx_jobs.jobs.queue import get_queue
from omlx_jobs.store import Store


def submitted(tmp_path: Path, sqlite_url: str, redis_url: str) -> tuple[Store, Redis, str, str]:
    src = tmp_path / "in.jsonl"
    body = {"messages": [{"role": "user", "content": "q"}], "max_tokens": 4}
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body} for i in range(3)]
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    store, redis = Store(sqlite_url), Redis.from_url(redis_url)
    done = actions.submit(store, redis, src, "some-model")
    assert done.enqueued, done.load
    store.transition(done.load.job_id, lifecycle.IN_PROGRESS, only_from=[lifecycle.VALIDATING])  # a worker began
    return store, redis, done.load.job_id, done.queue


def test_a_shard_in_transit_between_pop_and_registration_is_not_requeued(
    tmp_path: Path, sqlite_url: str, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker serving its priority queues pops with BLPOP; until it registers the shard, Redis holds it nowhere."""
    store, redis, _job, queue = submitted(tmp_path, sqlite_url, redis_url)
    key = get_queue(redis, queue).key
    message = redis.lpop(key)  # the worker took it...
    assert message is not None and redis.llen(key) == 0
    looks: list[float] = []

    def meanwhile(seconds: float) -> None:  # ...and registers it while reconcile waits to look again
        looks.append(seconds)
        redis.rpush(key, message)

    monkeypatch.setattr(actions.time, "sleep", meanwhile)
    assert actions.reconcile(store, redis, queue).requeued == []
    assert looks == [actions.IN_TRANSIT_SECONDS] and redis.llen(key) == 1  # no second copy


def test_a_shard_really_lost_is_requeued_after_the_second_look(
    tmp_path: Path, sqlite_url: str, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, redis, job, queue = submitted(tmp_path, sqlite_url, redis_url)
    key = get_queue(redis, queue).key
    redis.delete(key)  # Redis lost it (a restart without persistence)
    monkeypatch.setattr(actions.time, "sleep", lambda seconds: None)
    assert actions.reconcile(store, redis, queue).requeued == [job]
    assert redis.llen(key) == 1
