"""Benchmark: what the page's request indexes (migration 0005: status+idx, outcome+idx, custom_id) cost the write
paths, side by side in one run: the same 100k-request job stored and its results committed (8 per commit, as a
worker commits a decode step's results) into a store with them and one without them.

    .venv/bin/python bench/system/index_cost.py                   # SQLite, 100k requests
    .venv/bin/python bench/system/index_cost.py --requests 20000 --db-url postgresql+psycopg://postgres@127.0.0.1:5432/test

Prints seconds for each phase and the ratio with/without.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from sqlalchemy import text

PAGE_INDEXES = ("ix_requests_job_status_idx", "ix_requests_job_outcome_idx", "ix_requests_job_custom_id")


def _store(url: str, with_indexes: bool, schema: str | None) -> Any:
    from omlx_jobs.store import Store

    if schema:  # PostgreSQL: a schema of its own for each variant
        from sqlalchemy import create_engine

        engine = create_engine(url)
        with engine.begin() as conn:
            conn.execute(text(f"DROP SCHEMA IF EXISTS {schema} CASCADE"))
            conn.execute(text(f"CREATE SCHEMA {schema}"))
        engine.dispose()
        url = f"{url}?options=-csearch_path%3D{schema}"
    store = Store(url)
    if not with_indexes:
        with store.engine.begin() as conn:
            for name in PAGE_INDEXES:
                conn.execute(text(f"DROP INDEX {name}"))
    return store


def run(store: Any, n: int) -> tuple[float, float]:
    from omlx_jobs.store import CompletionRow

    store.create_job("batch_cost", "m", queue="omlx:m", status="in_progress")
    rows = [
        {"job_id": "batch_cost", "idx": i, "line": i + 1, "custom_id": f"req-{i:07d}", "endpoint": "/v1/completions",
         "body": {"prompt": f"question {i}"}, "sort_key": bytes([i % 251])}
        for i in range(n)
    ]  # fmt: skip
    t = time.perf_counter()
    for lo in range(0, n, 5000):
        store.add_requests(rows[lo : lo + 5000])
    insert = time.perf_counter() - t
    ids = [r.id for r in store.iter_requests("batch_cost", columns=["id"])]
    t = time.perf_counter()
    for lo in range(0, n, 8):
        store.record_completions(
            [CompletionRow(i, "an answer", "stop", 20, 0, 5) for i in ids[lo : lo + 8]]
        )  # fmt: skip
    commit = time.perf_counter() - t
    store.close()
    return insert, commit


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=100_000)
    ap.add_argument("--db-url", help="a PostgreSQL URL (default: SQLite files in a temporary folder)")
    args = ap.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for with_indexes in (False, True, False, True):  # twice each, interleaved, on a shared machine
            name = "with" if with_indexes else "without"
            if args.db_url:
                store = _store(args.db_url, with_indexes, f"bench_index_cost_{name}")
            else:
                path = Path(tmp) / f"{name}-{time.monotonic_ns()}.db"
                store = _store(f"sqlite:///{path}", with_indexes, None)
            insert, commit = run(store, args.requests)
            best = results.get(name, (float("inf"), float("inf")))
            results[name] = (min(best[0], insert), min(best[1], commit))
    (wi, wc), (oi, oc) = results["with"], results["without"]
    print(f"{args.requests:,} requests, {args.db_url.split('://')[0] if args.db_url else 'sqlite'} (best of 2)")
    print(f"  store the job:       {oi:6.2f} s without the page's indexes, {wi:6.2f} s with them ({wi / oi:.2f}x)")
    print(f"  commit its results:  {oc:6.2f} s without, {wc:6.2f} s with ({wc / oc:.2f}x; 8 results per commit)")


if __name__ == "__main__":
    main()
