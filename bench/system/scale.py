"""Benchmark: one job on several workers, and the store's cost per committed result (issue 10).

    .venv/bin/python bench/system/scale.py                       # both parts, defaults below
    .venv/bin/python bench/system/scale.py workers --requests 2000 --counts 1,2,3
    .venv/bin/python bench/system/scale.py store --results 2000 --writers 1,4 --pg-url postgresql+psycopg://...
    .venv/bin/python bench/system/scale.py rss --sizes 20000,200000        # one worker's peak RSS per job size

workers: the tiny test model, `omlx-jobs worker` processes on one Redis and one store, one job of N greedy
requests (8 tokens each, prefix groups under 8 system prompts, shards of N/20): wall time from submit to
completed with 1, 2 and 3 workers, measured in one run, the counts interleaved over --rounds.
store: `Store.record_completions` (what a worker calls after each decode step) from 1 and 4 writer processes
at once, 1 or 8 results per commit, on SQLite and PostgreSQL: microseconds per result and results/s.
Figures go to bench/RESULTS.md; the raw output to bench/results/ (pass --json FILE).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
SYSTEMS = [f"You are assistant {k}. Answer in one short sentence, politely and clearly. " * 3 for k in range(8)]


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


# ---- workers ------------------------------------------------------------------------------------------


def write_job(path: Path, n: int, max_tokens: int = 8) -> Path:
    with path.open("w") as f:
        for i in range(n):
            msgs = [{"role": "system", "content": SYSTEMS[i % 8]}, {"role": "user", "content": f"question {i}"}]
            f.write(json.dumps({"messages": msgs, "max_tokens": max_tokens, "temperature": 0}) + "\n")
    return path


def run_workers(model: Path, src: Path, count: int, env: dict[str, str], work: Path, n: int) -> dict[str, Any]:
    """Start `count` workers, wait until they listen, submit the job, time it to completion."""
    import redis

    from omlx_jobs.jobs.queue import queue_name
    from omlx_jobs.jobs.workers import list_workers, serving
    from omlx_jobs.store import open_store

    conn = redis.Redis.from_url(env["OMLX_JOBS_REDIS_URL"])
    args = ["--batch-size", "16", "--prefill-batch-size", "8"]
    cmd = [sys.executable, "-m", "omlx_jobs.cli", "worker", "--model", str(model), *args]
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for _ in range(count)]
    try:
        while len(serving(list_workers(conn), queue_name(str(model)))) < count:
            if any(p.poll() is not None for p in procs):
                raise SystemExit("a worker exited before it was ready")
            time.sleep(0.2)
        load = _load()
        start = time.perf_counter()
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "omlx_jobs.cli",
                "submit",
                str(src),
                "--model",
                str(model),
                "--shard-size",
                str(max(1, n // 20)),
            ],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        job = out.stdout.strip()
        store = open_store()
        while store.get_job(job).status != "completed":
            time.sleep(0.1)
        wall = time.perf_counter() - start
        counts = store.counts(job)
        shares = {w.worker: w.completed for w in store.job_workers(job)}
        store.close()
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            p.wait(60)
    return {
        "workers": count,
        "requests": n,
        "wall_s": round(wall, 2),
        "requests_per_s": round(n / wall, 1),
        "completion_tokens_per_s": round(counts.completion_tokens / wall, 1),
        "per_worker": sorted(shares.values(), reverse=True),
        "load_before": load,
    }


def bench_workers(opts: argparse.Namespace) -> list[dict[str, Any]]:
    from tests.tiny_model import build_tiny_model

    work = Path(tempfile.mkdtemp(prefix="omlx-scale-"))
    model = build_tiny_model(work / "tiny-model")
    src = write_job(work / "in.jsonl", opts.requests)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMLX_JOBS_")}
    env.update({"OMLX_JOBS_REDIS_URL": opts.redis_url, "OMLX_JOBS_HOME": str(work)})
    if opts.pg_url:
        env["OMLX_JOBS_DATABASE_URL"] = _pg_schema(opts.pg_url)
    else:
        env["OMLX_JOBS_DB"] = str(work / "jobs.db")
    os.environ.update({k: v for k, v in env.items() if k.startswith("OMLX_JOBS_")})
    rows = []
    for r in range(opts.rounds):
        for count in opts.counts:
            row = run_workers(model, src, count, env, work, opts.requests)
            row["round"] = r + 1
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


# ---- store cost per committed result ---------------------------------------------------------------


def _writer(url: str, job: str, ids: list[int], per_commit: int, barrier: Any, out: Any) -> None:
    from omlx_jobs.store import CompletionRow, Store

    store = Store(url)
    run = store.start_run(job, 0, 0, f"bench-{os.getpid()}", "m")
    text = "An answer of about sixty characters, as a short completion is. " * 2
    result = {"finish_reason": "stop", "prompt_tokens": 40, "cached_tokens": 32, "completion_tokens": 24}
    barrier.wait()
    start = time.perf_counter()
    for i in range(0, len(ids), per_commit):
        batch = [CompletionRow(id=rid, output_text=text, **result) for rid in ids[i : i + per_commit]]
        store.record_completions(batch, run_id=run)
    out.put(time.perf_counter() - start)
    store.close()


def store_cost(url: str, results: int, writers: int, per_commit: int = 1) -> dict[str, Any]:
    from omlx_jobs.store import Store

    store = Store(url)
    job = f"batch_bench_{uuid.uuid4().hex[:8]}"
    store.create_job(job, "m")
    store.add_requests(
        [
            {
                "job_id": job,
                "idx": i,
                "line": i + 1,
                "custom_id": f"c{i}",
                "endpoint": "/v1/completions",
                "body": {"prompt": "p"},
            }
            for i in range(results)
        ]
    )
    ids = [p.id for p in store.pending_requests(job)]
    ctx = multiprocessing.get_context("spawn")
    barrier, out = ctx.Barrier(writers), ctx.Queue()
    procs = [
        ctx.Process(target=_writer, args=(url, job, ids[w::writers], per_commit, barrier, out)) for w in range(writers)
    ]
    start = time.perf_counter()
    for p in procs:
        p.start()
    times = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    wall = max(times)
    stored = store.counts(job).completed
    store.close()
    assert stored == results, (stored, results)
    del start
    return {
        "backend": "postgresql" if url.startswith("postgresql") else "sqlite",
        "writers": writers,
        "results_per_commit": per_commit,
        "results": results,
        "us_per_result_per_writer": round(1e6 * sum(times) / results, 1),
        "results_per_s": round(results / wall, 1),
        "load_before": _load(),
    }


def bench_store(opts: argparse.Namespace) -> list[dict[str, Any]]:
    work = Path(tempfile.mkdtemp(prefix="omlx-store-"))
    urls = [f"sqlite:///{work / 'store.db'}"]
    if opts.pg_url:
        urls.append(_pg_schema(opts.pg_url))
    rows = []
    for _ in range(opts.rounds):
        for url in urls:
            for per_commit in opts.per_commit:
                for w in opts.writers:
                    row = store_cost(url, opts.results, w, per_commit)
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    return rows


def _pg_schema(url: str) -> str:
    from sqlalchemy import create_engine, text

    schema = f"bench_{uuid.uuid4().hex[:10]}"
    with create_engine(url).begin() as conn:
        conn.execute(text(f"CREATE SCHEMA {schema}"))
    return f"{url}{'&' if '?' in url else '?'}options=-csearch_path%3D{schema}"


# ---- peak RSS of one worker ------------------------------------------------------------------------


def _vm(pid: int, field: str) -> int:
    """A /proc/<pid>/status field in kB (0 once the process is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def rss_run(model: Path, n: int, env: dict[str, str], work: Path) -> dict[str, Any]:
    """Submit one job of n requests (max_tokens 1, default shards), then run one `omlx-jobs worker --burst` on
    it alone: its peak RSS is the kernel's, from wait4 on that process (ru_maxrss), and VmHWM read while it runs."""
    from omlx_jobs.store import open_store

    src = write_job(work / f"in-{n}.jsonl", n, max_tokens=1)
    cli = [sys.executable, "-m", "omlx_jobs.cli"]
    tic = time.perf_counter()
    job = subprocess.run(
        [*cli, "submit", str(src), "--model", str(model)], env=env, capture_output=True, text=True, check=True
    ).stdout.strip()
    submit_s = time.perf_counter() - tic
    load = _load()
    tic = time.perf_counter()
    log = (work / f"worker-{n}.log").open("wb")
    worker = subprocess.Popen(
        [*cli, "worker", "--model", str(model), "--burst"], env=env, stdout=subprocess.DEVNULL, stderr=log
    )
    hwm, samples = 0, []
    while True:  # reaped by wait4 (not Popen.poll), which hands back this child's own rusage
        pid, status, usage = os.wait4(worker.pid, os.WNOHANG)
        if pid == worker.pid:
            worker.returncode = os.waitstatus_to_exitcode(status)
            break
        hwm = max(hwm, _vm(worker.pid, "VmHWM"))
        samples.append((round(time.perf_counter() - tic, 1), _vm(worker.pid, "VmRSS")))
        time.sleep(1.0)
    wall = time.perf_counter() - tic
    store = open_store()
    counts, shards = store.counts(job), len(store.shards(job))
    store.close()
    return {
        "requests": n,
        "shards": shards,
        "completed": counts.completed,
        "submit_s": round(submit_s, 1),
        "worker_wall_s": round(wall, 1),
        "requests_per_s": round(n / wall, 1),
        "peak_rss_mb": round(usage.ru_maxrss / 1024, 1),
        "vmhwm_mb": round(hwm / 1024, 1),
        "rss_mb_over_time": [(t, round(kb / 1024, 1)) for t, kb in samples[:: max(1, len(samples) // 12)]],
        "exit": worker.returncode,
        "load_before": load,
        "load_after": _load(),
    }


def rss(opts: argparse.Namespace) -> list[dict[str, Any]]:
    """A worker's peak RSS on jobs of each size in --requests (max_tokens 1); the goal (issue 10): the largest
    within 10% of the smallest. The tiny test model, SQLite, one worker, nothing else on its Redis queue."""
    from tests.tiny_model import build_tiny_model

    rows = []
    for r in range(opts.rounds):
        for n in opts.sizes:
            work = Path(tempfile.mkdtemp(prefix="omlx-rss-"))
            model = build_tiny_model(work / "tiny-model")
            env = {k: v for k, v in os.environ.items() if not k.startswith("OMLX_JOBS_")}
            env.update({"OMLX_JOBS_REDIS_URL": opts.redis_url, "OMLX_JOBS_HOME": str(work)})
            env["OMLX_JOBS_DB"] = str(work / "jobs.db")
            os.environ.update({k: v for k, v in env.items() if k.startswith("OMLX_JOBS_")})
            row = rss_run(model, n, env, work)
            row["round"] = r + 1
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("part", nargs="?", default="all", choices=["all", "workers", "store", "rss"])
    ap.add_argument("--requests", type=int, default=2000, help="requests in the workers' job (default 2000)")
    ap.add_argument("--sizes", default="20000,200000", help="rss: job sizes (default 20000,200000)")
    ap.add_argument("--counts", default="1,2,3", help="worker counts (default 1,2,3)")
    ap.add_argument("--results", type=int, default=2000, help="results committed per store run (default 2000)")
    ap.add_argument("--writers", default="1,4", help="writer processes (default 1,4)")
    ap.add_argument(
        "--per-commit", default="1,8", help="results per commit: 1 as a worker at small batch, 8 as at a large one"
    )
    ap.add_argument("--rounds", type=int, default=1, help="repeat every configuration, interleaved (default 1)")
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/2")
    ap.add_argument(
        "--pg-url", default=os.environ.get("OMLX_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
    )
    ap.add_argument("--no-pg", action="store_true", help="SQLite only")
    ap.add_argument("--json", type=Path, help="also write every row here")
    opts = ap.parse_args()
    opts.counts = [int(x) for x in opts.counts.split(",")]
    opts.sizes = [int(x) for x in opts.sizes.split(",")]
    opts.writers = [int(x) for x in opts.writers.split(",")]
    opts.per_commit = [int(x) for x in opts.per_commit.split(",")]
    if opts.no_pg:
        opts.pg_url = None
    print(f"# {time.strftime('%Y-%m-%d %H:%M')} cpus={os.cpu_count()} load={_load()}", flush=True)
    rows: dict[str, Any] = {}
    if opts.part in ("all", "store"):
        rows["store"] = bench_store(opts)
    if opts.part in ("all", "workers"):
        rows["workers"] = bench_workers(opts)
    if opts.part == "rss":
        rows["rss"] = rss(opts)
    if opts.json:
        opts.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
