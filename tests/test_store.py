"""The store, once on SQLite and once on PostgreSQL (the `store_url` fixture)."""

from __future__ import annotations

import multiprocessing
import multiprocessing.synchronize
import os
import stat
from pathlib import Path

import pytest
from sqlalchemy import text

from omlx_jobs.errors import ErrorCode
from omlx_jobs.store import RequestStatus, Store, open_store
from omlx_jobs.store.db import JobNotFound, default_database_url
from omlx_jobs.store.models import JobStatus
from omlx_jobs.store.rows import CompletionRow


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


def test_statuses_and_codes_are_stored_as_their_text(store_url: str) -> None:
    """The enums are str enums: the columns hold the same text as the plain strings did, read back as str."""
    store = Store(store_url)
    job = make_job(store, n=2)
    assert store.transition(job, JobStatus.IN_PROGRESS, only_from=[JobStatus.VALIDATING])
    first = store.pending_requests(job)[0]
    assert store.record_failure(first.id, ErrorCode.CONTEXT_LENGTH_EXCEEDED, "too long")
    with store.engine.connect() as conn:
        status = conn.execute(text("select status from jobs where id = :j"), {"j": job}).scalar_one()
        rows = conn.execute(text("select status, error_code from requests where job_id = :j order by idx"), {"j": job})
        requests = [tuple(r) for r in rows]
    assert type(status) is str and status == "in_progress"
    assert requests == [("failed", "context_length_exceeded"), ("pending", None)]
    assert all(type(v) is str for v in requests[0])


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
    from omlx_jobs.store.shards import END_KEY, ShardCut

    store.add_shards(job, [ShardCut(0, 3, b"", 0, b"", 3), ShardCut(3, 5, b"", 3, END_KEY, 0)])
    assert [p.custom_id for p in store.pending_requests(job, 3, 5)] == ["c3", "c4"]
    assert [p.custom_id for p in store.pending_requests(job, 0, 3)] == []  # c0-c2 have final results
    assert [p.custom_id for p in store.pending_requests(job, 1, 3)] == []  # no shard starts there
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


# Text a model can emit that some database refuses as it is: NUL (PostgreSQL), lone surrogates (UTF-8), and
# the codec's own escape character with what follows it in an escape.
ODD_TEXTS = ["a\x00b", "\x00", "x\ud800y\udfff", "\ufdd0", "\ufdd00\ufdd01\ufdd0sd800", "plain", "", "é\x00\U0001f600"]


def test_any_model_text_round_trips_exactly(store_url: str) -> None:
    from omlx_jobs.jobs.output import OUTPUT_COLUMNS

    store = Store(store_url)
    job = make_job(store, len(ODD_TEXTS))
    pending = store.pending_requests(job)
    stored = store.record_completions(
        [
            CompletionRow(
                id=p.id,
                output_text=text,
                more_choices=[{"text": text + "!", "finish_reason": "stop"}, {"text": text, "finish_reason": "x"}],
                finish_reason="stop",
                prompt_tokens=1,
                cached_tokens=0,
                completion_tokens=1,
            )
            for p, text in zip(pending, ODD_TEXTS, strict=True)
        ]
    )
    assert stored == len(ODD_TEXTS)
    store.close()
    rows = list(Store(store_url).iter_requests(job, columns=OUTPUT_COLUMNS))  # a fresh connection reads them
    assert [r.output_text for r in rows] == ODD_TEXTS
    assert [r.more_choices[0]["text"] for r in rows] == [t + "!" for t in ODD_TEXTS]
    assert [r.more_choices[1]["text"] for r in rows] == ODD_TEXTS


def test_odd_custom_ids_and_error_messages_round_trip(store_url: str) -> None:
    store = Store(store_url)
    store.create_job("batch_odd", "m")
    store.add_requests(
        [
            {
                "job_id": "batch_odd",
                "idx": i,
                "line": i + 1,
                "custom_id": f"id{text}",
                "endpoint": "",
                "body": None,
                "status": RequestStatus.FAILED,
                "error_code": "invalid_value",
                "error_message": f"bad {text}",
            }
            for i, text in enumerate(ODD_TEXTS)
        ]
    )
    rows = list(store.iter_requests("batch_odd"))
    assert [r.custom_id for r in rows] == [f"id{t}" for t in ODD_TEXTS]
    assert [r.error_message for r in rows] == [f"bad {t}" for t in ODD_TEXTS]


def test_a_result_the_database_refuses_fails_alone(store_url: str) -> None:
    from omlx_jobs.store.db import UNSTORABLE

    store = Store(store_url)
    job = make_job(store, 3)
    a, b, c = store.pending_requests(job)
    run = store.start_run(job, 0, 3, "w1", "model-x")

    def result(rid: int, prompt_tokens: int) -> CompletionRow:
        return CompletionRow(
            id=rid,
            output_text="ok",
            finish_reason="stop",
            prompt_tokens=prompt_tokens,
            cached_tokens=0,
            completion_tokens=1,
        )

    # 2**64 fits no integer column (SQLite's driver and PostgreSQL's server both refuse it).
    assert store.record_completions([result(a.id, 1), result(b.id, 2**64), result(c.id, 3)], run_id=run) == 2
    rows = {r.custom_id: r for r in store.iter_requests(job)}
    assert (rows["c0"].status, rows["c2"].status) == ("completed", "completed")
    assert rows["c1"].status == "failed" and rows["c1"].error_code == UNSTORABLE
    assert "retry" in rows["c1"].error_message
    (share,) = store.job_workers(job)
    assert (share.worker, share.model, share.completed, share.failed) == ("w1", "model-x", 2, 1)
    assert store.record_completions([result(c.id, 3)]) == 0  # the store still works, and stays exactly-once


def _concurrent_writer(
    url: str, job: str, ids: list[int], n: int, barrier: multiprocessing.synchronize.Barrier
) -> None:
    store = Store(url)
    run = store.start_run(job, 0, 0, f"w{n}", "m")
    barrier.wait()
    for rid in ids:
        store.mark_started([rid])
        store.add_job_stats(job, prefill_tokens=1, cache_hits=1, peak_bytes=rid)
        result = CompletionRow(
            id=rid, output_text=f"w{n}", finish_reason="stop", prompt_tokens=1, cached_tokens=0, completion_tokens=1
        )
        store.record_completions([result], run_id=run)
    from omlx_jobs.jobs import lifecycle

    lifecycle.finalize_if_done(store, job)
    store.close()


def test_concurrent_writers_never_lose_an_update(store_url: str) -> None:
    """Four processes complete the same 60 requests at once (each tries all of them): every request gets
    exactly one result, every counter update lands, the job is finalized once."""
    from omlx_jobs.jobs import lifecycle

    store = Store(store_url)
    job = make_job(store, 60)
    store.transition(job, lifecycle.IN_PROGRESS)
    ids = [p.id for p in store.pending_requests(job)]
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(4)
    procs = [
        ctx.Process(target=_concurrent_writer, args=(store_url, job, ids if n % 2 else ids[::-1], n, barrier))
        for n in range(4)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(180)
    assert [p.exitcode for p in procs] == [0, 0, 0, 0]
    rows = list(store.iter_requests(job))
    assert all(r.status == "completed" and r.output_text in {"w0", "w1", "w2", "w3"} for r in rows)
    assert all(1 <= r.attempts <= 4 for r in rows)  # a writer counts an attempt only while it is pending
    info = store.get_job(job)
    assert (info.prefill_tokens, info.cache_hits, info.cache_peak_bytes) == (240, 240, max(ids))
    assert info.status == "completed"
    shares = store.job_workers(job)
    assert sum(s.completed for s in shares) == 60  # one result per request, credited to who stored it
    assert {r.output_text for r in rows} == {f"w{int(s.worker[1:])}" for s in shares if s.completed}


def test_the_job_is_finalized_exactly_once_when_shards_finish_together(store_url: str) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from omlx_jobs.jobs import lifecycle

    for round_ in range(3):
        store = Store(store_url)
        job = make_job(store, 2, job_id=f"batch_fin{round_}")
        store.transition(job, lifecycle.IN_PROGRESS)
        for p in store.pending_requests(job):
            store.record_failure(p.id, "x", "y")
        with ThreadPoolExecutor(8) as pool:
            won = list(pool.map(lifecycle.finalize, [store] * 8, [job] * 8))
        assert won.count(True) == 1, won
        assert store.get_job(job).status == "completed"
        store.close()


def test_shards_recording_their_plans_at_once_count_each_overlap_once(store_url: str) -> None:
    """Adjacent shards share a 3-token prefix at each boundary; however their plans interleave, the job's
    minimum is the sum less one overlap per boundary (the row lock makes the later recorder see the other)."""
    import struct
    from concurrent.futures import ThreadPoolExecutor

    from omlx_jobs.store.shards import ShardCut

    n = 12
    store = Store(store_url)
    job = make_job(store, 2 * n)
    store.add_shards(job, [ShardCut(2 * i, 2 * i + 2, b"", 2 * i, b"", 2 * i + 2) for i in range(n)])
    shared = struct.pack(">3I", 7, 8, 9)
    lead, tail = shared + struct.pack(">I", 1), shared + struct.pack(">2I", 2, 3)

    def record(i: int) -> bool:
        return store.record_shard_plan(job, 2 * i, 10, lead, tail)

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(record, range(n)))
    assert store.get_job(job).trie_min_tokens == 10 * n - 3 * (n - 1)
    assert not record(0)  # recorded once: a re-run adds nothing
    assert store.get_job(job).trie_min_tokens == 10 * n - 3 * (n - 1)


def test_pending_pages_are_keyset_pages_in_prefix_order(store_url: str) -> None:
    store = Store(store_url)
    job = "batch_pages"
    store.create_job(job, "model-x", queue="omlx:model-x", input_file="in.jsonl")
    keys = [bytes([i % 3, 7]) if i % 4 else b"" for i in range(23)]  # repeated keys: idx breaks the ties
    store.add_requests(
        [
            {
                "job_id": job,
                "idx": i,
                "line": i + 1,
                "custom_id": f"c{i}",
                "endpoint": "/v1/completions",
                "body": {"prompt": f"p{i}"},
                "sort_key": k,
            }
            for i, k in enumerate(keys)
        ]
    )
    whole = store.pending_requests(job)
    assert [p.idx for p in whole] == sorted(range(23), key=lambda i: (keys[i], i))
    store.record_failure(whole[5].id, "x", "done already")
    pages = list(store.pending_pages(job, page_rows=4))
    assert [len(p) for p in pages] == [4, 4, 4, 4, 4, 2]
    assert [p.idx for page in pages for p in page] == [p.idx for p in whole if p.id != whole[5].id]
    store.mark_started([whole[0].id, whole[1].id])
    store.mark_started([whole[0].id])
    store.refund_attempts([whole[0].id, whole[1].id, whole[2].id])  # never below zero
    assert [p.attempts for p in store.pending_requests(job)[:3]] == [1, 0, 0]
