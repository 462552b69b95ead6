"""The API's store tables and report queries, run once on SQLite and once on PostgreSQL."""

from __future__ import annotations

import time

from sqlalchemy import update

from omlx_jobs.api.ids import new_id
from omlx_jobs.jobs import lifecycle
from omlx_jobs.store import Request, open_store
from omlx_jobs.store.batches import EXPIRED_CODE, Batches
from omlx_jobs.store.files import ERRORS, INPUT, OUTPUT, Files
from omlx_jobs.store.reports import Reports


def _job(store, job_id: str, n: int) -> list[int]:  # type: ignore[no-untyped-def]
    store.create_job(job_id, "m", queue="omlx:m", status=lifecycle.IN_PROGRESS)
    store.add_requests(
        [{"job_id": job_id, "idx": i, "line": i + 1, "custom_id": f"c{i}", "endpoint": "/v1/completions",
          "body": {"prompt": "x"}} for i in range(n)]
    )  # fmt: skip
    store.update_job(job_id, total=n)
    return [r.id for r in store.iter_requests(job_id, columns=["id"])]


def test_files_page_by_id_cursor_and_keep_one_output_per_job(store_url: str) -> None:
    store = open_store(store_url)
    files = Files(store)
    ids = []
    for i in range(5):
        ids.append(new_id("file-"))
        files.add(id=ids[-1], purpose="batch", kind=INPUT, filename=f"f{i}", bytes=i, lines=i, scan={"models": {}})
        time.sleep(0.002)
    assert [f.id for f in files.page(after=None, limit=2, descending=True, purpose=None)] == ids[::-1][:2]
    assert [f.id for f in files.page(after=ids[1], limit=10, descending=False, purpose="batch")] == ids[2:]
    assert files.page(after=None, limit=10, descending=True, purpose="batch_output") == []
    first = files.add_job_file(id=new_id("file-"), purpose="batch_output", kind=OUTPUT, filename="o", job_id="j1")
    again = files.add_job_file(id=new_id("file-"), purpose="batch_output", kind=OUTPUT, filename="o", job_id="j1")
    assert again.id == first.id and first.bytes is None  # the second insert lost the race and got the first
    other = files.add_job_file(id=new_id("file-"), purpose="batch_output", kind=ERRORS, filename="e", job_id="j1")
    assert other.id != first.id
    files.set_bytes(first.id, 123)
    assert files.get(first.id).bytes == 123  # type: ignore[union-attr]
    files.add(id=new_id("file-"), purpose="batch", kind=INPUT, filename="old", created_at=1.0, expires_at=2.0)
    assert [f.filename for f in files.expired(now=3.0)] == ["old"]
    assert files.delete(ids[0]) and not files.delete(ids[0]) and files.get(ids[0]) is None
    store.close()


def test_batches_expire_only_unfinished_requests_and_finalize_once(store_url: str) -> None:
    store = open_store(store_url)
    batches = Batches(store)
    rids = _job(store, "batch_a", 4)
    store.record_completion(
        rids[0], output_text="x", finish_reason="stop", prompt_tokens=1, cached_tokens=0, completion_tokens=1
    )
    batches.add(job_id="batch_a", input_file_id="file-x", endpoint="/v1/completions", completion_window="24h",
                meta={"k": "v"}, created_at=10.0, expires_at=100.0)  # fmt: skip
    b = batches.get("batch_a")
    assert b is not None and b.meta == {"k": "v"} and b.output_file_id is None
    assert batches.due(99.0, [lifecycle.IN_PROGRESS]) == [] and batches.due(100.0, [lifecycle.IN_PROGRESS]) == [
        "batch_a"
    ]
    assert batches.expire_pending("batch_a", 101.0) == 3
    statuses = {
        r.custom_id: (r.status, r.error_code)
        for r in store.iter_requests("batch_a", columns=["custom_id", "status", "error_code"])
    }
    assert statuses["c0"] == ("completed", None)
    assert {statuses[f"c{i}"] for i in (1, 2, 3)} == {("cancelled", EXPIRED_CODE)}
    assert batches.unfinalized([lifecycle.EXPIRED]) == []
    store.transition("batch_a", lifecycle.EXPIRED)
    assert batches.unfinalized([lifecycle.EXPIRED]) == ["batch_a"]
    batches.finalize("batch_a", "file-o", None, 102.0)
    batches.finalize("batch_a", "file-other", "file-e", 103.0)  # once only
    b = batches.get("batch_a")
    assert b is not None and (b.output_file_id, b.error_file_id, b.finalized_at) == ("file-o", None, 102.0)
    assert [x.job_id for x in batches.page(after=None, limit=5)] == ["batch_a"]
    assert batches.page(after="batch_a", limit=5) == []
    store.close()


def test_throughput_buckets_and_first_errors_in_sql(store_url: str) -> None:
    store = open_store(store_url)
    reports = Reports(store)
    rids = _job(store, "batch_t", 6)
    t0 = 1_000_000.0
    # Finished at t0+0.5, +1.5, +1.9, +4.2 (prompt 10 each, completion 1..4); one failure; one pending.
    for rid, gen in zip(rids[:4], (1, 2, 3, 4), strict=True):
        store.record_completion(
            rid, output_text="x", finish_reason="stop", prompt_tokens=10, cached_tokens=4, completion_tokens=gen
        )
    with store.engine.begin() as conn:
        for rid, dt in zip(rids[:4], (0.5, 1.5, 1.9, 4.2), strict=True):
            conn.execute(update(Request).where(Request.id == rid).values(started_at=t0, finished_at=t0 + dt))
    store.record_failure(rids[4], "context_length_exceeded", "too long")
    buckets = reports.throughput("batch_t", 60)
    assert [b.seconds for b in buckets] == [1.0] * 5
    assert [b.completed for b in buckets] == [1, 2, 0, 0, 1]  # floor, not rounding, on both databases
    assert [b.completion_tokens for b in buckets] == [1, 5, 0, 0, 4]
    assert buckets[1].prompt_tokens_per_second == 20.0
    assert reports.first_errors("batch_t") == [
        {"line": 5, "custom_id": "c4", "code": "context_length_exceeded", "message": "too long"}
    ]
    assert reports.request_totals() == {"completed": 4, "failed": 1, "pending": 1}
    recent = reports.recent_tokens(["batch_t"], since=t0 + 1.0)
    assert recent == {"prompt": 30, "cached": 12, "completion": 9, "requests": 3}
    assert reports.active_jobs([lifecycle.IN_PROGRESS]) == ["batch_t"]
    assert reports.throughput("missing") == []
    store.close()
