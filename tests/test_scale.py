"""Many shards, many workers (issue 10) on real Redis and a real SQLite store, with the tiny model in this
process: prefix accounting across shards, the same-group preference, priorities, a shard that fails before
starting any request, resume while running, live workers."""

from __future__ import annotations

import json
import sqlite3
import threading
from pathlib import Path
from typing import Any

import pytest
import redis

from omlx_jobs.jobs import actions, affinity, lifecycle
from omlx_jobs.jobs.queue import get_queue, priority_queues, queue_name
from omlx_jobs.jobs.submit import load_job
from omlx_jobs.jobs.workers import WorkerInfo, list_workers, publish, retire, serving
from omlx_jobs.store import Store
from omlx_jobs.store.pending import PAGE_ROWS
from omlx_jobs.worker.engine.config import EngineConfig
from omlx_jobs.worker.engine.loop import Engine
from omlx_jobs.worker.engine.planner import plan
from omlx_jobs.worker.prompts import token_key
from omlx_jobs.worker.runtime import shard
from tests.fault_harness import invoke

SYSTEM = "You are a helpful assistant. Answer briefly and clearly, in one sentence please. " * 2
# Contents whose first characters differ, so requests share exactly the system prompt and the template.
FIRSTS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"


def chat_lines(path: Path, n: int, *, system: str = SYSTEM, max_tokens: int = 2) -> Path:
    with path.open("w") as f:
        for i in range(n):
            msgs = [{"role": "system", "content": system}, {"role": "user", "content": f"{FIRSTS[i % 62]}{i} why"}]
            f.write(json.dumps({"custom_id": f"q{i}", "messages": msgs, "max_tokens": max_tokens, "temperature": 0}))
            f.write("\n")
    return path


@pytest.fixture
def engine(tiny_loaded: Any) -> Engine:
    return Engine(tiny_loaded, EngineConfig(completion_batch_size=8, prefill_batch_size=4))


def run_all_shards(
    store: Store, engine: Engine, job: str, order: list[int] | None = None, page_rows: int = PAGE_ROWS
) -> None:
    shards = store.shards(job)
    for i in order or range(len(shards)):
        shard.run_shard(store, engine, job, shards[i].first_pos, shards[i].end_pos, worker="w", page_rows=page_rows)


def true_minimum(store: Store, engine: Engine, job: str) -> int:
    """The distinct prompt tokens of the whole job, from one trie over all its prompts."""
    keys = [token_key(engine.loaded.encode(r.endpoint, r.body)) for r in store.pending_requests(job)]
    return plan(keys).trie_min_tokens


def test_a_group_spanning_shards_has_the_single_shard_minimum(tmp_path: Path, engine: Engine) -> None:
    store = Store(f"sqlite:///{tmp_path / 'jobs.db'}")
    src = chat_lines(tmp_path / "in.jsonl", 40)
    one = load_job(store, src, "m", shard_size=1000).job_id
    many = load_job(store, src, "m", shard_size=8).job_id
    assert len(store.shards(one)) == 1 and len(store.shards(many)) >= 4
    truth = true_minimum(store, engine, one)
    run_all_shards(store, engine, one)
    shards = store.shards(many)
    run_all_shards(store, engine, many, order=[*range(1, len(shards), 2), *range(0, len(shards), 2)])
    single = store.get_job(one).trie_min_tokens
    assert single == truth
    assert store.get_job(many).trie_min_tokens == single  # not the sum of the shards' minimums
    assert sum(s.trie_min_tokens or 0 for s in store.shards(many)) > single
    # Re-running a shard adds nothing (its minimum was recorded once).
    shard.run_shard(store, engine, many, shards[0].first_pos, shards[0].end_pos)
    assert store.get_job(many).trie_min_tokens == single


def test_the_job_minimum_is_never_below_the_truth(tmp_path: Path, engine: Engine) -> None:
    # Two system prompts, users sharing words past the system prompt (sharing the boundaries cannot see):
    # the job's minimum may be above the true one, never below it, and below the sum of the shards'.
    store = Store(f"sqlite:///{tmp_path / 'jobs.db'}")
    src = tmp_path / "mixed.jsonl"
    with src.open("w") as f:
        for i in range(36):
            system = SYSTEM if i % 3 else "Extract the names, dates and places from this document. " * 3
            msgs = [{"role": "system", "content": system}, {"role": "user", "content": f"question number {i}"}]
            f.write(json.dumps({"messages": msgs, "max_tokens": 1, "temperature": 0}) + "\n")
    job = load_job(store, src, "m", shard_size=6).job_id
    truth = true_minimum(store, engine, job)
    run_all_shards(store, engine, job)
    got = store.get_job(job).trie_min_tokens
    assert truth <= got < sum(s.trie_min_tokens or 0 for s in store.shards(job))
    assert lifecycle.finalize_if_done(store, job) == "completed"


@pytest.fixture
def conn(redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(redis_url)


def test_a_finished_shard_claims_the_next_of_its_group_first(tmp_path: Path, conn: redis.Redis) -> None:
    store = Store(f"sqlite:///{tmp_path / 'jobs.db'}")
    src = chat_lines(tmp_path / "in.jsonl", 60)
    sub = actions.submit(store, conn, src, "m", shard_size=10)
    job = sub.load.job_id
    shards = store.shards(job)
    assert len(shards) >= 4 and all(s.group_first == s.group_last for s in shards)  # one group throughout
    q = get_queue(conn, sub.queue)
    ids = q.get_job_ids()
    # Another job's shard sits at the front of the queue: a plain dequeue would take it first.
    other = actions.submit(store, conn, chat_lines(tmp_path / "b.jsonl", 3, system="Other. " * 30), "m").enqueued
    q_ids = q.get_job_ids()
    conn.lrem(q.key, 1, other[0])
    conn.lpush(q.key, other[0])
    assert q.get_job_ids()[0] == other[0] and set(q_ids) == set(q.get_job_ids())
    conn.lrem(q.key, 1, ids[0])  # shard 0 "ran"; shard 1 continues its group
    names = priority_queues(queue_name("m"))
    claimed = affinity.claim_same_group(conn, store, names, job, shards[0].first_pos)
    assert claimed == (ids[1], sub.queue)
    assert ids[1] not in q.get_job_ids()  # taken out of the queue for this worker alone
    # Two workers finishing shards of the group at once: each shard is claimed by exactly one of them.
    results: list[Any] = []
    barrier = threading.Barrier(8)

    def claim() -> None:
        barrier.wait()
        results.append(affinity.claim_same_group(conn, store, names, job, shards[0].first_pos))

    threads = [threading.Thread(target=claim) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    taken = [r[0] for r in results if r is not None]
    assert len(taken) == len(set(taken)) == len(shards) - 2
    # Higher-priority work first: with a high job queued, no preference.
    conn.rpush(q.key, ids[2])
    high = actions.submit(store, conn, chat_lines(tmp_path / "h.jsonl", 2), "m", priority="high")
    assert high.queue == f"{sub.queue}:high"
    assert affinity.claim_same_group(conn, store, names, job, shards[0].first_pos) is None


def _worker(store: Store, engine: Engine, conn: redis.Redis, qname: str, *extra: str) -> Any:
    from omlx_jobs.worker import entry
    from omlx_jobs.worker.runtime.rq_worker import serve

    ctx = entry.WorkerContext(store=store, engine=engine, redis=conn, queue=qname)
    entry.install(ctx)
    try:
        return serve(ctx, qname, burst=True, heartbeat_ttl=3), ctx
    finally:
        entry.install(None)


def test_a_burst_worker_takes_high_priority_first_and_records_who_ran_what(
    tmp_path: Path, conn: redis.Redis, engine: Engine, tiny_model_dir: Path
) -> None:
    store = Store(f"sqlite:///{tmp_path / 'jobs.db'}")
    model = str(tiny_model_dir)
    low = actions.submit(store, conn, chat_lines(tmp_path / "l.jsonl", 6), model, priority="low").load.job_id
    normal = actions.submit(store, conn, chat_lines(tmp_path / "n.jsonl", 6), model).load.job_id
    high = actions.submit(store, conn, chat_lines(tmp_path / "h.jsonl", 6), model, priority="high").load.job_id
    code, ctx = _worker(store, engine, conn, queue_name(model))
    assert code == 0
    finished = {j: store.get_job(j).completed_at for j in (low, normal, high)}
    assert finished[high] < finished[normal] < finished[low], finished
    (share,) = store.job_workers(high)
    assert (share.worker, share.model, share.completed) == (ctx.name, model, 6)
    out = tmp_path / "out.jsonl"
    code, _, err = invoke({"OMLX_JOBS_DB": str(tmp_path / "jobs.db")}, "results", high, "-o", str(out))
    assert code == 0, err
    assert {json.loads(x)["response"]["body"]["model"] for x in out.read_text().splitlines()} == {model}


def test_a_shard_failing_before_any_request_starts_is_given_up(
    tmp_path: Path, conn: redis.Redis, engine: Engine, tiny_model_dir: Path
) -> None:
    db = tmp_path / "jobs.db"
    store = Store(f"sqlite:///{db}")
    model = str(tiny_model_dir)
    job = actions.submit(store, conn, chat_lines(tmp_path / "in.jsonl", 30), model, shard_size=10).load.job_id
    first = store.shards(job)[0]
    in_first = {p.id for p in store.pending_requests(job, first.first_pos, first.end_pos)}
    with sqlite3.connect(db) as raw:  # a row the planner chokes on: its shard fails before admitting anything
        raw.execute("UPDATE requests SET body = ? WHERE id = ?", ('{"prompt": "x", "n": "x"}', min(in_first)))
    code, _ = _worker(store, engine, conn, queue_name(model))
    assert code == 0  # the burst worker ends: the shard is not re-enqueued without end
    rows = list(store.iter_requests(job))
    bad = [r for r in rows if r.id in in_first]
    assert len(bad) == first.end_pos - first.first_pos
    assert {r.error_code for r in bad} == {shard.SHARD_FAILED}
    assert all("failed 3 times before any request started" in r.error_message for r in bad)
    assert all("ValueError" in r.error_message and "omlx-jobs retry" in r.error_message for r in bad)
    assert all(r.attempts == 0 for r in bad)  # no request was charged for it
    assert all(r.status == "completed" for r in rows if r.id not in in_first)
    assert store.get_shard(job, first.first_pos).failures == 3
    assert store.get_job(job).status == "completed"


def test_resume_is_refused_while_the_job_runs(tmp_path: Path, conn: redis.Redis, redis_url: str) -> None:
    store = Store(f"sqlite:///{tmp_path / 'jobs.db'}")
    sub = actions.submit(store, conn, chat_lines(tmp_path / "in.jsonl", 20), "m", shard_size=10)
    before = get_queue(conn, sub.queue).get_job_ids()
    with pytest.raises(actions.JobBusy, match="queued or started"):
        actions.resume(store, conn, sub.load.job_id)
    env = {"OMLX_JOBS_DB": str(tmp_path / "jobs.db"), "OMLX_JOBS_REDIS_URL": redis_url}
    code, _, err = invoke(env, "resume", sub.load.job_id)
    assert code == 1 and "is running" in err
    assert get_queue(conn, sub.queue).get_job_ids() == before  # no duplicate shard
    conn.delete(get_queue(conn, sub.queue).key)  # the queue lost its shards: now resume puts them back
    assert len(actions.resume(store, conn, sub.load.job_id)) == len(before)


def test_live_workers_are_listed_and_expire(conn: redis.Redis) -> None:
    publish(conn, WorkerInfo(name="w1", model="m", queues=["omlx:m"], state="busy", job_id="batch_x", shard="0-10"), 30)
    publish(conn, WorkerInfo(name="w2", model="n", queues=["omlx:n"]), 1)
    assert [w.name for w in list_workers(conn)] == ["w1", "w2"]
    assert [w.name for w in serving(list_workers(conn), "omlx:m")] == ["w1"]
    conn.delete("omlx:worker:w2")  # as its TTL would
    (w1,) = list_workers(conn)
    assert (w1.model, w1.job_id, w1.shard, w1.state) == ("m", "batch_x", "0-10", "busy") and w1.last_heartbeat > 0
    retire(conn, "w1")
    assert list_workers(conn) == [] and conn.smembers("omlx:workers") == set()


def test_status_says_when_no_live_worker_serves_the_model(tmp_path: Path, conn: redis.Redis, redis_url: str) -> None:
    store = Store(f"sqlite:///{tmp_path / 'jobs.db'}")
    job = actions.submit(store, conn, chat_lines(tmp_path / "in.jsonl", 2), "some-model").load.job_id
    env = {"OMLX_JOBS_DB": str(tmp_path / "jobs.db"), "OMLX_JOBS_REDIS_URL": redis_url}
    code, out, _ = invoke(env, "status", job)
    assert code == 0 and f"no live worker serves {queue_name('some-model')}:" in out
    assert json.loads(invoke(env, "status", job, "--json")[1])["live_workers"] == 0
    publish(conn, WorkerInfo(name="w", model="some-model", queues=priority_queues(queue_name("some-model"))), 30)
    code, out, _ = invoke(env, "status", job)
    assert "no live worker" not in out
    assert json.loads(invoke(env, "status", job, "--json")[1])["live_workers"] == 1
    code, out, _ = invoke(env, "workers")
    assert code == 0 and "some-model" in out and "idle" in out


def test_a_shard_larger_than_a_page_is_read_and_planned_page_by_page(
    tmp_path: Path, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = Store(f"sqlite:///{tmp_path / 'jobs.db'}")
    src = chat_lines(tmp_path / "in.jsonl", 40)
    whole = load_job(store, src, "m", shard_size=1000).job_id
    paged = load_job(store, src, "m", shard_size=1000).job_id
    run_all_shards(store, engine, whole)
    reads: list[int] = []
    pages = store.pending_pages

    def spy(*args: Any, **kw: Any) -> Any:
        for page in pages(*args, **kw):
            reads.append(len(page))
            yield page

    monkeypatch.setattr(store, "pending_pages", spy)
    run_all_shards(store, engine, paged, page_rows=8)
    assert reads == [8, 8, 8, 8, 8]
    assert {r.status for r in store.iter_requests(paged)} == {"completed"}
    # One group over five pages: each page's plan counts the shared prefix again, never below the truth.
    truth = store.get_job(whole).trie_min_tokens
    (one,) = store.shards(paged)
    assert truth < store.get_job(paged).trie_min_tokens == one.trie_min_tokens
    assert [r.output_text for r in store.iter_requests(paged)] == [r.output_text for r in store.iter_requests(whole)]
