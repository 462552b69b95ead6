"""Alembic migrations, once on SQLite and once on PostgreSQL: a database of release 0.1.0 (create_all, no
alembic_version) upgrades in place with its rows intact; several processes opening a new database at once
upgrade it once; the migrated schema is the models' schema."""

from __future__ import annotations

import multiprocessing
import time

import pytest
from sqlalchemy import create_engine, inspect, text

from omlx_jobs.store import Store
from omlx_jobs.store.migrations import HEAD
from tests import legacy_schema_v010 as legacy


def _legacy_database(url: str) -> None:
    """A database exactly as release 0.1.0 left it: its tables, a job mid-run, results with odd text."""
    engine = create_engine(url)
    legacy.Base.metadata.create_all(engine)
    now = time.time()
    with engine.begin() as conn:
        conn.execute(
            legacy.Job.__table__.insert(),
            [
                {
                    "id": "batch_old",
                    "model": "m",
                    "queue": "omlx:m",
                    "status": "in_progress",
                    "total": 5,
                    "options": {"shard_size": 2, "shard_timeout": 60},
                    "created_at": now,
                    "prefill_tokens": 7,
                    "trie_min_tokens": 0,
                    "cache_hits": 1,
                    "cache_misses": 2,
                    "cache_evictions": 0,
                    "cache_peak_bytes": 10,
                }
            ],
        )
        conn.execute(
            legacy.Request.__table__.insert(),
            [
                {
                    "job_id": "batch_old",
                    "idx": i,
                    "line": i + 1,
                    "custom_id": f"c{i}",
                    "endpoint": "/v1/completions",
                    "body": {"prompt": f"p{i}"},
                    "status": "completed" if i < 2 else "pending",
                    # 0.1.0 stored text as given; a U+FDD0 in it must still read back unchanged.
                    "output_text": ["plain", "odd \ufdd0 0 text"][i] if i < 2 else None,
                    "attempts": 1 if i < 2 else 0,
                    "created_at": now,
                }
                for i in range(5)
            ],
        )
    engine.dispose()


def test_a_database_from_release_0_1_0_is_upgraded_in_place(store_url: str) -> None:
    _legacy_database(store_url)
    store = Store(store_url)
    with store.engine.connect() as conn:
        assert conn.execute(text("SELECT version_num FROM alembic_version")).scalar() == HEAD
        assert {"shards", "shard_runs"} <= set(inspect(conn).get_table_names())
    job = store.get_job("batch_old")
    assert (job.status, job.total, job.prefill_tokens, job.options["shard_size"]) == ("in_progress", 5, 7, 2)
    rows = list(store.iter_requests("batch_old"))
    assert [r.custom_id for r in rows] == [f"c{i}" for i in range(5)]
    assert [r.output_text for r in rows[:2]] == ["plain", "odd \ufdd0 0 text"]
    assert {r.sort_key for r in rows} == {b""}  # an empty key: prefix order is file order, the old cut is kept
    # Shards cut as 0.1.0 cut them, so a worker (or reconcile) carries on with the pending requests.
    assert [(s.first_pos, s.end_pos) for s in store.shards("batch_old")] == [(0, 2), (2, 4), (4, 5)]
    assert [(s.first_pos, s.end_pos) for s in store.shards("batch_old", pending_only=True)] == [(2, 4), (4, 5)]
    assert [p.custom_id for p in store.pending_requests("batch_old", 2, 4)] == ["c2", "c3"]
    assert [p.custom_id for p in store.pending_requests("batch_old", 4, 5)] == ["c4"]
    store.close()
    Store(store_url).close()  # opening again is a no-op


def _open_and_write(url: str, n: int, barrier: multiprocessing.synchronize.Barrier) -> None:
    barrier.wait()
    store = Store(url)
    store.create_job(f"batch_p{n}", "m")
    store.close()


def test_processes_opening_a_new_database_at_once_upgrade_it_once(store_url: str) -> None:
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(4)
    procs = [ctx.Process(target=_open_and_write, args=(store_url, n, barrier)) for n in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0, 0, 0]
    store = Store(store_url)
    assert sorted(j.id for j in store.list_jobs()) == [f"batch_p{n}" for n in range(4)]
    with store.engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM alembic_version")).scalar() == 1


# Alembic cannot reflect an expression index (requests' outcome index, 0005) and leaves it out of the comparison;
# tests/test_store_pages.py checks that the planner uses it.
@pytest.mark.filterwarnings("ignore:.*expression-based index")
def test_the_migrated_schema_is_the_models_schema(store_url: str) -> None:
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    from omlx_jobs.store.models import Base

    store = Store(store_url)
    with store.engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    assert diff == []
