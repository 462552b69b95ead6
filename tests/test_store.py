"""The store, once on SQLite and once on PostgreSQL (the `store_url` fixture)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from omlx_jobs.store import RequestStatus, Store, open_store
from omlx_jobs.store.db import JobNotFound, default_database_url


def make_job(store: Store, n: int = 5, job_id: str = "batch_test") -> str:
    store.create_job(job_id, "model-x", queue="omlx:model-x", input_file="in.jsonl")
    store.add_requests(
        [
            {
                "job_id": job_id,
                "idx": i,
                "line": i + 1,
                "custom_id": f"c{i}",
                "endpoint": "/v1/completions",
                "body": {"prompt": f"p{i}", "max_tokens": 3},
            }
            for i in range(n)
        ]
    )
    store.update_job(job_id, total=n)
    return job_id


def test_job_lifecycle_and_counts(store_url: str) -> None:
    store = Store(store_url)
    job = make_job(store)
    assert store.get_job(job).status == "validating"
    assert store.transition(job, "in_progress", only_from=["validating"])
    assert not store.transition(job, "in_progress", only_from=["validating"])
    info = store.get_job(job)
    assert info.status == "in_progress" and info.in_progress_at is not None and info.total == 5

    pending = store.pending_requests(job)
    assert [p.custom_id for p in pending] == ["c0", "c1", "c2", "c3", "c4"]
    assert pending[0].body == {"prompt": "p0", "max_tokens": 3}
    store.mark_started([p.id for p in pending[:2]])
    assert store.record_completion(
        pending[0].id, output_text="hi", finish_reason="stop", prompt_tokens=4, cached_tokens=1, completion_tokens=2
    )
    # A second result for the same request is refused: there is never a duplicate.
    assert not store.record_completion(
        pending[0].id, output_text="again", finish_reason="stop", prompt_tokens=4, cached_tokens=0, completion_tokens=9
    )
    assert store.record_failure(pending[1].id, "context_length_exceeded", "too long")
    assert store.cancel_pending(job, [pending[2].id]) == 1

    c = store.counts(job)
    assert (c.total, c.completed, c.failed, c.cancelled, c.pending) == (5, 1, 1, 1, 2)
    assert (c.prompt_tokens, c.cached_tokens, c.completion_tokens) == (4, 1, 2)
    assert [p.custom_id for p in store.pending_requests(job, 3, 5)] == ["c3", "c4"]
    assert [p.custom_id for p in store.pending_requests(job, 0, 4)] == ["c3"]
    rows = list(store.iter_requests(job, batch_size=2))
    assert [r.custom_id for r in rows] == ["c0", "c1", "c2", "c3", "c4"]
    assert rows[0].output_text == "hi" and rows[0].attempts == 1 and rows[1].error_code == "context_length_exceeded"


def test_retry_resets_failed_and_optionally_cancelled(store_url: str) -> None:
    store = Store(store_url)
    job = make_job(store, 3)
    ids = [p.id for p in store.pending_requests(job)]
    store.record_failure(ids[0], "engine_error", "boom")
    store.cancel_pending(job, [ids[1]])
    assert store.reset_for_retry(job) == 1
    assert store.counts(job).pending == 2
    assert store.reset_for_retry(job, include_cancelled=True) == 1
    assert store.counts(job).pending == 3


def test_job_stats_add_atomically(store_url: str) -> None:
    store = Store(store_url)
    job = make_job(store, 1)
    store.add_job_stats(job, prefill_tokens=10, trie_min_tokens=8, cache_hits=2, peak_bytes=100)
    store.add_job_stats(job, prefill_tokens=5, cache_misses=1, peak_bytes=50)
    info = store.get_job(job)
    assert (info.prefill_tokens, info.trie_min_tokens, info.cache_hits, info.cache_misses) == (15, 8, 2, 1)
    assert info.cache_peak_bytes == 100


def test_unknown_job_says_what_to_do(store_url: str) -> None:
    store = Store(store_url)
    with pytest.raises(JobNotFound, match="omlx-jobs jobs"):
        store.get_job("nope")


def test_sqlite_file_is_private_and_in_wal_mode(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "jobs.db"
    store = open_store(db_path=path)
    make_job(store, 1)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    with store.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"


def test_database_url_resolution(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("OMLX_JOBS_DATABASE_URL", raising=False)
    monkeypatch.delenv("OMLX_JOBS_DB", raising=False)
    monkeypatch.setenv("OMLX_JOBS_HOME", str(tmp_path / "home"))
    assert default_database_url() == f"sqlite:///{tmp_path / 'home' / 'omlx-jobs.db'}"
    monkeypatch.setenv("OMLX_JOBS_DB", str(tmp_path / "x.db"))
    assert default_database_url() == f"sqlite:///{tmp_path / 'x.db'}"
    monkeypatch.setenv("OMLX_JOBS_DATABASE_URL", "postgresql+psycopg://u@h/db")
    assert default_database_url() == "postgresql+psycopg://u@h/db"
    assert default_database_url(tmp_path / "y.db") == f"sqlite:///{tmp_path / 'y.db'}"


def test_request_statuses_are_final_once_set(store_url: str) -> None:
    store = Store(store_url)
    job = make_job(store, 2)
    ids = [p.id for p in store.pending_requests(job)]
    store.record_failure(ids[0], "x", "y")
    assert not store.record_failure(ids[0], "x", "again")
    assert store.cancel_pending(job) == 1
    assert set(store.request_statuses(job).values()) == {RequestStatus.FAILED, RequestStatus.CANCELLED}


def test_retry_never_revives_invalid_input_lines(store_url: str) -> None:
    store = Store(store_url)
    store.create_job("batch_bad", "m")
    store.add_requests(
        [
            {
                "job_id": "batch_bad",
                "idx": 0,
                "line": 1,
                "custom_id": "ok",
                "endpoint": "/v1/completions",
                "body": {"prompt": "p"},
            },
            {
                "job_id": "batch_bad",
                "idx": 1,
                "line": 2,
                "custom_id": "line-2",
                "endpoint": "",
                "body": None,
                "status": RequestStatus.FAILED,
                "error_code": "invalid_json",
                "error_message": "bad",
            },
        ]
    )
    (ok,) = store.pending_requests("batch_bad")
    store.record_failure(ok.id, "engine_error", "boom")
    assert store.reset_for_retry("batch_bad") == 1  # only the request that ran
    assert store.request_statuses("batch_bad") == {"ok": "pending", "line-2": "failed"}


def test_retry_can_keep_permanent_failures(store_url: str) -> None:
    store = Store(store_url)
    job = make_job(store, 2)
    a, b = (p.id for p in store.pending_requests(job))
    store.record_failure(a, "context_length_exceeded", "too long")
    store.record_failure(b, "engine_error", "boom")
    assert store.reset_for_retry(job, retry_codes=["engine_error"]) == 1
    assert store.request_statuses(job) == {"c0": "failed", "c1": "pending"}
