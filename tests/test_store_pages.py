"""The page's store reads on SQLite and PostgreSQL: request pages (status, outcome, custom_id search, keyset paging
both ways), outcomes, token histograms, the job list's filters and cursor, live ticks."""

from __future__ import annotations

from typing import Any

import pytest

from omlx_jobs.store import CompletionRow, Store
from omlx_jobs.store.reports import HISTOGRAM_STEP, JobFilter, Reports
from omlx_jobs.store.request_pages import PREVIEW_CHARS, Cursor, RequestFilter, RequestPages

N = 60


def _job(store: Store, job_id: str, *, model: str = "gguf:/m/Tiny.gguf", name: str | None = "Tiny") -> list[int]:
    store.create_job(job_id, model, queue="omlx:m", status="in_progress", model_name=name)
    rows = [
        {
            "job_id": job_id,
            "idx": i,
            "line": i + 1,
            "custom_id": f"item-{i:03d}" if i != 7 else "special_100%",
            "endpoint": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "long " * 2000 if i == 5 else f"question {i}"}]},
            "sort_key": b"",
        }
        for i in range(N)
    ]
    store.add_requests(rows)
    store.update_job(job_id, total=N)
    return [r.id for r in store.iter_requests(job_id, columns=["id"])]


def _finish(store: Store, ids: list[int]) -> None:
    """0-29 completed (every third `length`, the rest `stop`; 10 tokens per idx), 30-34 failed, 35-59 pending."""
    rows = [
        CompletionRow(
            id=ids[i],
            output_text=f"answer {i}" + ("x" * 9000 if i == 3 else ""),
            finish_reason="length" if i % 3 == 0 else "stop",
            prompt_tokens=100 + i,
            cached_tokens=0,
            completion_tokens=10 * i,
        )
        for i in range(30)
    ]
    store.record_completions(rows)
    for i in range(30, 35):
        store.record_failure(ids[i], "engine_error" if i < 33 else "context_length_exceeded", "boom")


@pytest.fixture
def store(store_url: str) -> Any:
    s = Store(store_url)
    yield s
    s.close()


def test_request_pages_filter_search_and_page_both_ways(store: Store) -> None:
    _finish(store, _job(store, "batch_a"))
    _job(store, "batch_other")  # another job's rows never show
    pages = RequestPages(store)

    first = pages.page("batch_a", RequestFilter(), limit=25)
    assert [r.idx for r in first.rows] == list(range(25)) and first.has_after and not first.has_before
    second = pages.page("batch_a", RequestFilter(), after=Cursor(first.rows[-1].idx), limit=25)
    assert [r.idx for r in second.rows] == list(range(25, 50)) and second.has_before
    back = pages.page("batch_a", RequestFilter(), before=Cursor(second.rows[0].idx), limit=25)
    assert [r.idx for r in back.rows] == list(range(25)) and not back.has_before and back.has_after

    failed = pages.page("batch_a", RequestFilter(status="failed"))
    assert [r.idx for r in failed.rows] == [30, 31, 32, 33, 34]
    length = pages.page("batch_a", RequestFilter(outcome="length"), limit=4)
    assert [r.idx for r in length.rows] == [0, 3, 6, 9] and length.has_after
    more = pages.page("batch_a", RequestFilter(outcome="length"), after=Cursor(9), limit=50)
    assert [r.idx for r in more.rows] == [12, 15, 18, 21, 24, 27] and not more.has_after
    codes = pages.page("batch_a", RequestFilter(outcome="context_length_exceeded"))
    assert [(r.idx, r.error_code) for r in codes.rows] == [
        (33, "context_length_exceeded"),
        (34, "context_length_exceeded"),
    ]

    found = pages.page("batch_a", RequestFilter(custom_id_prefix="item-04"))
    assert [r.custom_id for r in found.rows] == [f"item-04{d}" for d in range(10)]
    assert pages.page("batch_a", RequestFilter(custom_id_prefix="ITEM-04")).rows == []  # prefixes match as typed
    assert [r.idx for r in pages.page("batch_a", RequestFilter(custom_id_prefix="special_1")).rows] == [7]
    assert pages.page("batch_a", RequestFilter(custom_id_prefix="special%")).rows == []  # LIKE wildcards are literal
    paged = pages.page("batch_a", RequestFilter(custom_id_prefix="item-0"), limit=3)
    cursor = Cursor(paged.rows[-1].idx, paged.rows[-1].custom_id)
    assert Cursor.decode(cursor.encode()) == cursor
    nxt = pages.page("batch_a", RequestFilter(custom_id_prefix="item-0"), after=cursor, limit=3)
    assert [r.custom_id for r in nxt.rows] == ["item-003", "item-004", "item-005"]


def test_request_previews_are_cut_in_sql_and_a_row_reads_whole(store: Store) -> None:
    ids = _job(store, "batch_a")
    _finish(store, ids)
    rows = {r.idx: r for r in RequestPages(store).page("batch_a", RequestFilter(), limit=10).rows}
    assert len(rows[3].output_text) == PREVIEW_CHARS and rows[3].output_chars == len("answer 3") + 9000
    assert rows[5].body_chars > PREVIEW_CHARS >= len(rows[5].body_text)
    assert rows[1].output_text == "answer 1" and rows[1].body_text.startswith("{")
    whole = RequestPages(store).request_row("batch_a", 3)
    assert whole.output_text == "answer 3" + "x" * 9000 and whole.body["messages"][0]["content"] == "question 3"
    assert RequestPages(store).request_row("batch_a", N) is None


def test_outcomes_and_token_histograms(store: Store) -> None:
    _finish(store, _job(store, "batch_a"))
    reports = Reports(store)
    assert reports.outcomes("batch_a") == {"stop": 20, "length": 10, "engine_error": 3, "context_length_exceeded": 2}
    steps = reports.token_steps("batch_a")
    assert sum(steps["completion"].values()) == sum(steps["prompt"].values()) == 30
    assert steps["completion"] == _steps([10 * i for i in range(30)])
    assert steps["prompt"] == _steps([100 + i for i in range(30)])
    assert reports.status_counts(["batch_a", "batch_none"]) == {
        "batch_a": {"completed": 30, "failed": 5, "pending": 25},
        "batch_none": {},
    }


def _steps(values: list[int]) -> dict[int, int]:
    out: dict[int, int] = {}
    for v in values:
        out[v // HISTOGRAM_STEP] = out.get(v // HISTOGRAM_STEP, 0) + 1
    return out


def test_the_job_list_filters_and_pages(store: Store) -> None:
    for i in range(7):
        _job(store, f"batch_{i:02d}", model=f"gguf:/m/M{i % 2}.gguf", name=f"M{i % 2}")
        store.update_job(f"batch_{i:02d}", created_at=1000.0 + (i // 2))  # pairs share a creation time
    store.transition("batch_03", "completed")
    reports = Reports(store)
    page = reports.jobs_page(JobFilter(), limit=3)
    assert [j.id for j in page] == ["batch_06", "batch_05", "batch_04"]
    rest = reports.jobs_page(JobFilter(), before=(page[-1].created_at, page[-1].id), limit=10)
    assert [j.id for j in rest] == ["batch_03", "batch_02", "batch_01", "batch_00"]
    assert [j.id for j in reports.jobs_page(JobFilter(status="completed"))] == ["batch_03"]
    assert [j.id for j in reports.jobs_page(JobFilter(model="M1"))] == ["batch_05", "batch_03", "batch_01"]
    assert [j.id for j in reports.jobs_page(JobFilter(model="gguf:/m/M1.gguf"))] == ["batch_05", "batch_03", "batch_01"]
    assert [j.id for j in reports.jobs_page(JobFilter(id_prefix="batch_0"))][:2] == ["batch_06", "batch_05"]
    assert reports.jobs_page(JobFilter(id_prefix="nope")) == []
    assert reports.job_models() == ["M0", "M1"]


def test_live_ticks_are_read_by_job_and_time(store: Store) -> None:
    _job(store, "batch_a")
    _job(store, "batch_b")
    row = store.add_tick("batch_a", "w1", 100.0, 102.0, 30, 50, 4)
    store.extend_tick(row, 104.0, 10, 20, 3)
    store.add_tick("batch_a", "w2", 100.0, 110.0, 0, 5, 1)
    store.add_tick("batch_b", "w1", 90.0, 95.0, 1, 1, 0)
    ticks = store.job_ticks("batch_a")
    assert [(t.worker, t.started_at, t.ended_at, t.prompt_tokens, t.completion_tokens, t.in_flight) for t in ticks] == [
        ("w1", 100.0, 104.0, 40, 70, 3),
        ("w2", 100.0, 110.0, 0, 5, 1),
    ]
    assert [t.worker for t in store.job_ticks("batch_a", since=105.0)] == ["w2"]
    assert sorted(t.job_id for t in store.recent_ticks(["batch_a", "batch_b"], since=94.0)) == [
        "batch_a",
        "batch_a",
        "batch_b",
    ]
    store.delete_job("batch_a")  # a removed job takes its ticks along
    assert store.job_ticks("batch_a") == []


def test_the_pages_queries_are_index_ranges_on_sqlite(sqlite_url: str) -> None:
    """Each statement of a filtered page or a search reads requests through the index made for it, whatever the
    job's size (the bench checks the whole page the same way: bench/system/page_load.py)."""
    from sqlalchemy import event

    store = Store(sqlite_url)
    _finish(store, _job(store, "batch_a"))
    seen: list[tuple[str, Any]] = []
    event.listen(
        store.engine, "before_cursor_execute", lambda c, cur, sql, params, ctx, many: seen.append((sql, params))
    )
    pages = RequestPages(store)
    expected = {
        "ix_requests_job_outcome_idx": RequestFilter(outcome="length"),
        "ix_requests_job_status_idx": RequestFilter(status="failed"),
        "ix_requests_job_custom_id": RequestFilter(custom_id_prefix="item-01"),
    }
    for index, where in expected.items():
        seen.clear()
        pages.page("batch_a", where, after=Cursor(3, "item-003" if where.custom_id_prefix else None))
        ((sql, params),) = seen
        with store.engine.connect() as conn:
            plan = " | ".join(r[-1] for r in conn.exec_driver_sql("EXPLAIN QUERY PLAN " + sql, params))
        assert plan.startswith("SEARCH requests USING INDEX " + index), plan
    store.close()
