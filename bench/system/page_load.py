"""Benchmark: the web page on a job of 100,000 requests among 1,000 jobs, in a SQLite store made with the store's
own calls (no model, no Redis needed: the workers' tab reads an empty Redis or says it is down).

    .venv/bin/python bench/system/page_load.py                     # 100k requests, 999 small jobs beside it
    .venv/bin/python bench/system/page_load.py --requests 1000000  # a job of a million
    .venv/bin/python bench/system/page_load.py --no-browser        # server side only

It prints, for the job's page and the job list, each as the page refreshes it (the job's JSON, its requests
table and the workers; or the list and the workers): the JSON bytes per refresh, the server's time per refresh
(cold: first load; warm: the refreshes after), the store queries per refresh, and the plan of every distinct
query: none may read the requests table but through an index range (SQLite's SEARCH, never SCAN). With a
browser (Debian's chromium), the page's load time to the first complete render, cold and warm.
Exits 1 when a query scans.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # tests/cdp.py drives the browser

JOB = "batch_bench_page_load_000001"
WORKERS = ("gpu-a.1", "gpu-b.1", "gpu-c.1")
REASONS = ("stop", "stop", "stop", "length")
ERRORS = ("context_length_exceeded", "engine_error", "invalid_image")


def build(path: Path, requests: int, small_jobs: int) -> None:
    """The store: one large job (60% completed, 2% failed, the rest pending, 30 minutes of live counts from 3
    workers) and `small_jobs` finished ones of 20 requests."""
    from omlx_jobs.jobs.live import TickWriter
    from omlx_jobs.store import open_store

    store = open_store(f"sqlite:///{path}")
    rng = random.Random(0)
    t0 = time.time() - 1800
    for j in range(small_jobs):
        job_id = f"batch_bench_small_{j:06d}"
        store.create_job(job_id, f"gguf:/models/model-{j % 4}.gguf", queue="omlx:m", status="in_progress",
                         model_name=f"model-{j % 4}")  # fmt: skip
        _add_requests(store, job_id, 20)
        ids = [r.id for r in store.iter_requests(job_id, columns=["id"])]
        store.record_completions([_row(i, rng) for i in ids])
        store.update_job(job_id, total=20, created_at=t0 - 86400 + j)
        store.transition(job_id, "completed")
    store.create_job(JOB, "gguf:/models/SmolLM2-135M-Instruct.Q4_1.gguf", queue="omlx:m", status="in_progress",
                     model_name="SmolLM2-135M-Instruct.Q4_1")  # fmt: skip
    _add_requests(store, JOB, requests)
    store.update_job(JOB, total=requests, created_at=t0)
    ids = [r.id for r in store.iter_requests(JOB, columns=["id"])]
    done = int(requests * 0.6)
    for k in range(0, done, 5000):
        store.record_completions([_row(i, rng) for i in ids[k : min(k + 5000, done)]])
    for i in ids[done : done + requests // 50]:
        store.record_failure(i, rng.choice(ERRORS), "a failure the bench made up")
    for worker in WORKERS:  # 30 minutes of counts, a tick every 2 s, as TickWriter writes them
        clock = [t0]
        counters = _Counters()
        writer = TickWriter(store, counters, JOB, worker, t0, clock=lambda c=clock: c[0])
        for _ in range(900):
            clock[0] += 2.0
            counters.add(rng.randint(200, 400), rng.randint(180, 220), 32)
            writer.maybe_tick()
    store.close()


class _Counters:
    def __init__(self) -> None:
        self.values = (0, 0, 0)

    def add(self, prompt: int, generated: int, in_flight: int) -> None:
        self.values = (self.values[0] + prompt, self.values[1] + generated, in_flight)

    def snapshot(self) -> tuple[int, int, int]:
        return self.values


def _add_requests(store: Any, job_id: str, n: int) -> None:
    for lo in range(0, n, 5000):
        store.add_requests(
            [
                {
                    "job_id": job_id,
                    "idx": i,
                    "line": i + 1,
                    "custom_id": f"req-{i:07d}",
                    "endpoint": "/v1/chat/completions",
                    "body": {"messages": [{"role": "user", "content": f"question {i} " * 30}], "max_tokens": 256},
                    "sort_key": bytes([i % 251]),
                }
                for i in range(lo, min(lo + 5000, n))
            ]
        )


def _row(request_id: int, rng: random.Random) -> Any:
    from omlx_jobs.store import CompletionRow

    return CompletionRow(
        id=request_id,
        output_text="An answer of some length. " * rng.randint(1, 40),
        finish_reason=rng.choice(REASONS),
        prompt_tokens=rng.randint(40, 700),
        cached_tokens=20,
        completion_tokens=rng.randint(1, 256),
    )


# ---- the server, its queries ------------------------------------------------------------------------------


@contextmanager
def serve(db: Path, tmp: Path) -> Iterator[tuple[str, Any]]:
    import uvicorn

    from omlx_jobs.api import ServeConfig, create_app
    from tests.fault_harness import free_port

    config = ServeConfig(db_url=f"sqlite:///{db}", redis_url="redis://127.0.0.1:1/0", files_dir=tmp / "files")
    app = create_app(config, housekeeping=False)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", app.state.omlx
    finally:
        server.should_exit = True
        thread.join(timeout=20)


class Queries:
    """Every statement the store runs, from a SQLAlchemy event listener."""

    def __init__(self, engine: Any) -> None:
        from sqlalchemy import event

        self.engine, self.seen, self.on = engine, [], False
        event.listen(engine, "before_cursor_execute", self._record)

    def _record(self, conn: Any, cursor: Any, statement: str, params: Any, context: Any, many: bool) -> None:
        if self.on and not statement.lstrip().upper().startswith(("PRAGMA", "EXPLAIN")):
            self.seen.append((statement, params))

    @contextmanager
    def counting(self) -> Iterator[list[tuple[str, Any]]]:
        self.seen, self.on = [], True
        try:
            yield self.seen
        finally:
            self.on = False

    def plans(self, statements: list[tuple[str, Any]]) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        with self.engine.connect() as conn:
            for sql, params in statements:
                if sql in out:
                    continue
                rows = conn.exec_driver_sql("EXPLAIN QUERY PLAN " + sql, params).all()
                out[sql] = [r[-1] for r in rows]
        return out


def fetch(url: str) -> int:
    with urllib.request.urlopen(url, timeout=120) as r:
        return len(r.read())


def refresh(base: str, paths: list[str], queries: Queries) -> tuple[float, int, list[tuple[str, Any]]]:
    """One refresh: the page's requests in turn; (seconds, JSON bytes, store statements)."""
    with queries.counting() as seen:
        t = time.perf_counter()
        size = sum(fetch(base + p) for p in paths)
        took = time.perf_counter() - t
    return took, size, list(seen)


def settle(state: Any) -> None:
    """Wait until the page's background reads (api/page_cache.py) are done: warm figures are the steady state."""
    from omlx_jobs.api.page import cache_of

    while cache_of(state)._reading:
        time.sleep(0.05)


def measure(base: str, name: str, paths: list[str], queries: Queries, state: Any, warm: int = 5) -> dict[str, Any]:
    cold, size, statements = refresh(base, paths, queries)
    settle(state)
    times, counts = [], []
    for _ in range(warm):
        took, size, seen = refresh(base, paths, queries)
        times.append(took)
        counts.append(len(seen))
        statements += seen
    plans = queries.plans(statements)
    scans = [(sql, p) for sql, p in plans.items() if any(line.startswith("SCAN") and "requests" in line for line in p)]
    print(f"{name}: {size / 1024:.1f} KiB JSON per refresh; server {cold * 1000:.0f} ms cold, "
          f"{min(times) * 1000:.0f}-{max(times) * 1000:.0f} ms warm; store queries per warm refresh {counts} "
          f"({len(plans)} distinct; the job's whole-range reads are kept by api/page_cache.py)")  # fmt: skip
    for sql, plan in plans.items():
        print(f"    {' | '.join(plan):90.90}  <- {' '.join(sql.split())[:110]}")
    return {"name": name, "bytes": size, "cold_s": cold, "warm_s": times, "queries": counts, "scans": scans}


def browser_load(base: str, path: str) -> tuple[float, float]:
    """Seconds from navigation to the page's first complete render, cold (new browser) and warm (reload)."""
    from tests.cdp import Browser

    with tempfile.TemporaryDirectory() as tmp:
        b = Browser(Path(tmp))
        try:
            out = []
            for _ in range(2):
                t = time.perf_counter()
                b.goto(base + path)
                b.wait_for("document.body.dataset.loaded === '1'", timeout=120)
                out.append(time.perf_counter() - t)
                b.eval("delete document.body.dataset.loaded; true")
            assert b.exceptions == [], b.exceptions
            return out[0], out[1]
        finally:
            b.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=100_000)
    ap.add_argument("--jobs", type=int, default=999, help="small finished jobs beside the large one")
    ap.add_argument("--no-browser", action="store_true")
    ap.add_argument("--db", type=Path, help="keep the store here (built when missing, reused when there)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        db = args.db or tmp / "jobs.db"
        if not db.exists():
            t = time.perf_counter()
            build(db, args.requests, args.jobs)
            print(f"store: {args.requests:,} requests in one job, {args.jobs} jobs beside it, built in "
                  f"{time.perf_counter() - t:.1f} s ({db.stat().st_size / 1e6:.0f} MB)")  # fmt: skip
        with serve(db, tmp) as (base, state):
            queries = Queries(state.store.engine)
            job_paths = [f"/api/jobs/{JOB}", f"/api/jobs/{JOB}/requests", "/api/workers"]
            job = measure(base, "job page", job_paths, queries, state)
            search = measure(base, "requests searched", [f"/api/jobs/{JOB}/requests?q=req-00999"], queries, state)
            errors = [f"/api/jobs/{JOB}/requests?outcome=engine_error"]
            failed = measure(base, "requests filtered", errors, queries, state)
            jobs = measure(base, "job list", ["/api/jobs", "/api/workers"], queries, state)
            if not args.no_browser:
                cold, warm = browser_load(base, f"/jobs/{JOB}")
                print(f"job page in chromium: {cold * 1000:.0f} ms to the first full render (new browser), "
                      f"{warm * 1000:.0f} ms reloaded")  # fmt: skip
                cold, warm = browser_load(base, "/")
                print(f"job list in chromium: {cold * 1000:.0f} ms (new browser), {warm * 1000:.0f} ms reloaded")
    scans = [s for m in (job, search, failed, jobs) for s in m["scans"]]
    if scans:
        print("queries that scan the requests table:", json.dumps(scans, indent=1)[:2000])
        return 1
    print("no query reads the requests table but through an index range")
    return 0


if __name__ == "__main__":
    sys.exit(main())
