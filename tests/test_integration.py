"""Issue 10's integration test, on real Redis and real PostgreSQL: three `omlx-jobs worker` processes on the
tiny model share one job of 1,000 sampled requests (temperature 1). Every request is done exactly once, every
worker runs some shards, the job is finalized once, and every output (NUL included) round-trips: the export
from PostgreSQL equals a one-process run of the same file on SQLite (seeded, so batching does not matter)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import redis

from omlx_jobs.jobs.queue import priority_queues, queue_name
from omlx_jobs.jobs.workers import list_workers, serving
from omlx_jobs.store import open_store
from tests.fault_harness import invoke, shards_taken

N = 1000
WORKERS = 3
SYSTEMS = [f"You are assistant {k}. Answer briefly and clearly, in one sentence please. " * 2 for k in range(4)]


def write_sampled(path: Path) -> Path:
    """Chat lines under four system prompts and completions; temperature 1 with a seed per request."""
    with path.open("w") as f:
        for i in range(N):
            if i % 5 == 4:
                line: dict[str, Any] = {"prompt": f"Once upon a time {i}"}
            else:
                line = {
                    "messages": [{"role": "system", "content": SYSTEMS[i % 4]}, {"role": "user", "content": f"q {i}"}]
                }
            f.write(json.dumps({"custom_id": f"r{i}", **line, "max_tokens": 6, "temperature": 1, "seed": i}) + "\n")
    return path


def texts(path: Path) -> dict[str, str]:
    out = {}
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = json.loads(raw)
        choice = line["response"]["body"]["choices"][0]
        out[line["custom_id"]] = choice.get("text", choice.get("message", {}).get("content"))
    return out


def test_three_workers_one_job_on_postgres(tmp_path: Path, redis_url: str, pg_url: str, tiny_model_dir: Path) -> None:
    src = write_sampled(tmp_path / "in.jsonl")
    ref_env = {"OMLX_JOBS_DB": str(tmp_path / "ref.db"), "OMLX_JOBS_HOME": str(tmp_path / "home")}
    code, _, err = invoke(ref_env, "run", str(src), "--model", str(tiny_model_dir), "-o", str(tmp_path / "ref.jsonl"))
    assert code == 0, err
    expected = texts(tmp_path / "ref.jsonl")
    assert len(expected) == N and any("\x00" in t for t in expected.values()), "no NUL to round-trip this time"

    env = {k: v for k, v in os.environ.items() if not k.startswith("OMLX_JOBS_")}
    env.update({"OMLX_JOBS_DATABASE_URL": pg_url, "OMLX_JOBS_REDIS_URL": redis_url, "OMLX_JOBS_HOME": str(tmp_path)})
    args = ["--batch-size", "8", "--prefill-batch-size", "4", "--heartbeat-ttl", "5"]
    logs = [tmp_path / f"worker-{i}.log" for i in range(WORKERS)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "omlx_jobs.cli", "-v", "worker", "--model", str(tiny_model_dir), *args],
            env=env,
            stdout=log.open("wb"),
            stderr=subprocess.STDOUT,
        )
        for log in logs
    ]
    conn = redis.Redis.from_url(redis_url)
    qname = queue_name(str(tiny_model_dir))
    try:
        deadline = time.monotonic() + 120
        while len(serving(list_workers(conn), qname)) < WORKERS:
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), _tails(logs)
            time.sleep(0.2)
        assert {w.queues[0] for w in list_workers(conn)} == {priority_queues(qname)[0]}
        code, out, err = invoke(env, "submit", str(src), "--model", str(tiny_model_dir), "--shard-size", "40")
        assert code == 0, err
        job = out.strip()
        store = open_store(url=pg_url)
        deadline = time.monotonic() + 300
        seen_busy: set[str] = set()  # `omlx-jobs workers` shows each worker on its shard of this job
        while store.get_job(job).status != "completed":
            assert time.monotonic() < deadline, _tails(logs)
            seen_busy |= {w.name for w in list_workers(conn) if w.job_id == job and w.state == "busy" and w.shard}
            time.sleep(0.2)
        status = json.loads(invoke(env, "status", job, "--json")[1])
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        codes = [p.wait(timeout=60) for p in procs]
    assert codes == [0] * WORKERS, _tails(logs)

    assert status["request_counts"] == {"total": N, "completed": N, "failed": 0, "cancelled": 0, "pending": 0}
    rows = list(store.iter_requests(job, columns=["custom_id", "status", "attempts", "run_id"]))
    assert len(rows) == N and all(r.status == "completed" and r.attempts == 1 for r in rows)  # each ran once
    # Every worker ran shards, and status --json says who did how much.
    ran = {w["worker"]: w["completed"] for w in status["workers"]}
    assert len(ran) == WORKERS and all(n > 0 for n in ran.values()) and sum(ran.values()) == N, ran
    assert all(shards_taken(log) for log in logs)
    assert seen_busy and seen_busy <= set(ran), (seen_busy, ran)
    assert list_workers(conn) == []  # each retired its record on the way out
    finalized = sum(log.read_text().count(f"job {job} finalized") for log in logs)
    assert finalized == 1
    # Every output round-trips through PostgreSQL, NUL included.
    code, _, err = invoke(env, "results", job, "-o", str(tmp_path / "out.jsonl"))
    assert code == 0, err
    got = texts(tmp_path / "out.jsonl")
    wrong = [k for k in expected if got.get(k) != expected[k]]
    assert wrong == [], f"{len(wrong)} outputs differ, e.g. {wrong[:3]}"
    # Prefix accounting: the job's minimum is never below the true one (the one-shard run's), and close to it.
    ref = open_store(db_path=tmp_path / "ref.db")
    truth = ref.get_job(ref.list_jobs()[0].id).trie_min_tokens
    assert truth <= status["prefix"]["trie_min_tokens"] <= 1.1 * truth, (truth, status["prefix"])


def _tails(logs: list[Path]) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in logs if p.exists())
