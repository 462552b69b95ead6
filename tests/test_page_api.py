"""The page's JSON over a real server (uvicorn on loopback, SQLite, Redis): the job list's filters and cursor,
a job's live figures from live counts in the store, outcomes and histograms, the requests table's filters and
cursors, one request whole, clear 400s and 404s, /metrics' live gauges, and GET /v1/batches?after=UNKNOWN."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2 as httpx
import openai
import pytest

from omlx_jobs.api.page import histogram
from omlx_jobs.api.page_cache import PageCache
from omlx_jobs.api.page_requests import input_preview
from omlx_jobs.store import CompletionRow
from tests.api_harness import chat_line, live_server, openai_client, write_lines
from tests.test_api import KEY, Env, create, upload

AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture
def env(tmp_path: Path, redis_url: str, tiny_model_dir: Path) -> Iterator[Env]:
    e = Env(tmp_path, redis_url, tiny_model_dir)
    yield e
    e.close()


@pytest.fixture
def server(env: Env) -> Iterator[str]:
    with live_server(env.config()) as url:
        yield url


def get(url: str, path: str, expect: int = 200, **params: Any) -> Any:
    r = httpx.get(url + path, params=params, headers=AUTH)
    assert r.status_code == expect, r.text[:2000]
    return r.json()


def _batch(env: Env, url: str, n: int, name: str = "in.jsonl") -> str:
    client = openai_client(url)
    lines = [chat_line(i, max_tokens=16) for i in range(n)]
    return create(client, upload(client, write_lines(env.tmp / name, lines)).id).id  # type: ignore[no-any-return]


def _finish_some(env: Env, job_id: str) -> None:
    """Results as a worker stores them: 0-9 completed (stop, then length from 6), 10-11 failed, the rest pending."""
    rows = {r.idx: r.id for r in env.store.iter_requests(job_id, columns=["id", "idx"])}
    env.store.record_completions(
        [
            CompletionRow(rows[i], f"answer {i}", "length" if i >= 6 else "stop", 40 + i, 0, 16 if i >= 6 else 5)
            for i in range(10)
        ]
    )
    for i in (10, 11):
        env.store.record_failure(rows[i], "engine_error", "it broke")


def test_a_job_shows_live_figures_from_the_stores_counts(env: Env, server: str) -> None:
    job_id = _batch(env, server, 30)
    _finish_some(env, job_id)
    now = time.time()
    for w, rate in (("w1", 100), ("w2", 50)):  # two workers counting for the last 30 s, a row per 2 s
        for t in range(30, 0, -2):
            env.store.add_tick(job_id, w, now - t, now - t + 2, rate, 2 * rate, 8)
    view = get(server, f"/api/jobs/{job_id}")
    live = view["live"]
    assert live["generated_tokens_per_second"] == pytest.approx(150, rel=0.05)
    assert live["prompt_tokens_per_second"] == pytest.approx(75, rel=0.05)
    assert live["requests_in_flight"] == 16 and len(live["workers"]) == 2
    # 18 unfinished requests expected to generate 9.4 tokens each (the mean so far: 6 x 5 + 4 x 16), less what
    # the 16 in flight generated already (at most 16 x 9.4), at 150 tok/s.
    assert view["eta"]["state"] == "tokens" and view["eta"]["expected_completion_tokens"] == pytest.approx(9.4)
    assert view["eta"]["remaining_tokens"] == int(18 * 9.4) - int(16 * 9.4)
    assert view["eta_seconds"] == pytest.approx(view["eta"]["remaining_tokens"] / 150, abs=0.06)
    assert view["outcomes"] == {"stop": 6, "length": 4, "engine_error": 2}
    assert sum(b["count"] for b in view["histograms"]["completion"]) == 10
    assert view["shares"]["completed"] == pytest.approx(10 / 30) and view["shares"]["failed"] == pytest.approx(2 / 30)
    assert len(view["throughput_series"]) >= 10 and view["model_name"] == "tiny"
    assert view["details"]["model"] == str(env.model)

    values = _metrics(server)
    assert values[("omlx_tokens_per_second", (("kind", "generated"),))] == pytest.approx(150, rel=0.05)
    assert values[("omlx_job_requests_in_flight", (("job", job_id), ("model", "tiny")))] == 16
    assert values[("omlx_requests_in_flight", ())] == 16


def _metrics(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", headers=AUTH).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def test_the_requests_table_filters_pages_and_reads_one_whole(env: Env, server: str) -> None:
    job_id = _batch(env, server, 30)
    _finish_some(env, job_id)
    path = f"/api/jobs/{job_id}/requests"
    first = get(server, path, limit=8)
    assert [r["custom_id"] for r in first["rows"]] == [f"req-{i}" for i in range(8)] and first["first"] is None
    second = get(server, path, limit=8, after=first["last"])
    assert [r["idx"] for r in second["rows"]] == list(range(8, 16))
    back = get(server, path, limit=8, before=second["first"])
    assert [r["idx"] for r in back["rows"]] == list(range(8))
    row = first["rows"][2]
    assert row["input"] == "user: question 2" and row["output"] == "answer 2" and row["outcome"] == "stop"
    assert [r["idx"] for r in get(server, path, outcome="length")["rows"]] == [6, 7, 8, 9]
    failed = get(server, path, status="failed")["rows"]
    assert [(r["idx"], r["output"]) for r in failed] == [(10, "engine_error: it broke"), (11, "engine_error: it broke")]
    assert [r["custom_id"] for r in get(server, path, q="req-2")["rows"]] == [
        "req-2",
        *(f"req-2{d}" for d in range(10)),
    ]

    whole = get(server, f"/api/jobs/{job_id}/requests/3")
    assert whole["request"]["custom_id"] == "req-3" and whole["request"]["url"] == "/v1/chat/completions"
    assert whole["result"]["response"]["body"]["choices"][0]["message"]["content"] == "answer 3"
    assert get(server, f"/api/jobs/{job_id}/requests/20")["result"] is None  # pending: no result yet

    assert "after" in get(server, path, 400, after="nope")["error"]["message"]
    assert get(server, path, 400, status="done")["error"]["param"] == "status"
    assert get(server, f"/api/jobs/{job_id}/requests/999", 404)["error"]["param"] == "idx"
    assert get(server, "/api/jobs/batch_nope/requests", 404)["error"]["code"] == "job_not_found"
    assert get(server, "/api/jobs/batch_nope", 404)["error"]["code"] == "job_not_found"


def test_the_job_list_pages_and_filters(env: Env, server: str) -> None:
    ids = [_batch(env, server, 3, name=f"in{i}.jsonl") for i in range(5)]
    openai_client(server).batches.cancel(ids[1])
    page = get(server, "/api/jobs", limit=2)
    assert [j["id"] for j in page["jobs"]] == ids[:2:-1][:2] == [ids[4], ids[3]]
    rest = get(server, "/api/jobs", limit=10, before=page["next"])
    assert [j["id"] for j in rest["jobs"]] == [ids[2], ids[1], ids[0]] and rest["next"] is None
    cancelled = get(server, "/api/jobs", status="cancelled")["jobs"]
    assert [(j["id"], j["cancelled"], j["total"]) for j in cancelled] == [(ids[1], 3, 3)]
    assert cancelled[0]["shares"]["cancelled"] == 1.0 and cancelled[0]["model"] == "tiny"
    assert [j["id"] for j in get(server, "/api/jobs", model="tiny")["jobs"]] == ids[::-1]
    assert get(server, "/api/jobs", model="other")["jobs"] == [] and page["models"] == ["tiny"]
    assert [j["id"] for j in get(server, "/api/jobs", q=ids[3])["jobs"]] == [ids[3]]
    assert get(server, "/api/jobs", 400, before="x")["error"]["param"] == "before"
    assert get(server, "/api/jobs", 400, status="running")["error"]["param"] == "status"


def test_listing_batches_after_an_unknown_id_is_a_400(env: Env, server: str) -> None:
    _batch(env, server, 2)
    client = openai_client(server)
    with pytest.raises(openai.BadRequestError) as exc:
        client.batches.list(after="batch_01a2b3c4d5e6f7a8b9c0d1e2")
    assert exc.value.status_code == 400 and "after" in str(exc.value)
    assert len(client.batches.list().data) == 1


def test_histogram_bins_span_the_counts() -> None:
    assert histogram({}) == []
    bins = histogram({5: 3, 6: 1})  # counts 40-47 and 48-55
    assert [(b["lo"], b["hi"], b["count"]) for b in bins] == [(40, 48, 3), (48, 56, 1)]
    wide = histogram({k: 1 for k in range(100)}, bins=24)
    assert len(wide) <= 24 and sum(b["count"] for b in wide) == 100 and wide[0]["lo"] == 0
    assert all(b["hi"] - b["lo"] == wide[0]["hi"] - wide[0]["lo"] for b in wide)


def test_the_page_cache_keeps_reads_by_their_cost_and_serves_slow_ones_stale() -> None:
    import threading

    clock = [0.0]
    cache = PageCache(clock=lambda: clock[0])
    calls: list[str] = []

    def slow() -> str:
        calls.append("slow")
        clock[0] += 0.5  # a read that took half a second: kept 20 x as long, then served stale while read again
        return f"v{len(calls)}"

    assert cache.get("k", 1, slow) == "v1"
    clock[0] += 5
    assert cache.get("k", 1, slow) == "v1" and len(calls) == 1
    clock[0] += 6
    assert cache.get("k", 1, slow) == "v1"  # stale after 10 s: served at once, the new value read behind it
    _until(lambda: cache.peek("k", 1) == (True, "v2"))
    assert cache.get("k", 2, slow) == "v2"  # another version (the job's status changed): stale too
    _until(lambda: cache.peek("k", 2) == (True, "v3"))

    fast = iter(range(100)).__next__  # a cheap read is read again at once, never served stale
    assert [cache.get("c", 1, fast) for _ in range(3)] == [0, 1, 2]
    assert cache.get("done", 1, slow, ended=True) == "v4"
    clock[0] += 1e6
    assert cache.get("done", 1, slow, ended=True) == "v4"  # an ended job's figures stay

    gate = threading.Event()
    first = cache.get("big", 1, lambda: gate.wait(10) and "counted", wait=0.05)
    assert first is None  # a first read past `wait`: nothing now, the value later
    gate.set()
    _until(lambda: cache.get("big", 1, lambda: "again", wait=0.05) == "counted")
    cache.close()


def _until(cond: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_input_previews() -> None:
    body = '{"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url"}]}]}'
    assert input_preview(body, len(body)) == ("user: hi [image_url]", False)
    assert input_preview('{"prompt": [1, 2, 3]}', 21) == ("[3 token ids]", False)
    text, cut = input_preview('{"prompt": "' + "x" * 500 + '"}', 514)
    assert cut and len(text) < 200
    assert input_preview('{"messages": [{"role": "us', 10**6)[1] is True  # a body larger than the part read


def test_a_job_without_live_counts_plots_its_results_times(env: Env, server: str) -> None:
    job_id = _batch(env, server, 30)
    _finish_some(env, job_id)  # results, but no live counts: a job run before workers counted live
    view = get(server, f"/api/jobs/{job_id}")
    assert view["live"]["generated_tokens"] == 0 and view["eta"]["state"] == "estimating"
    series = view["throughput_series"]
    assert series and sum(b["completion_tps"] * b["seconds"] for b in series) == 6 * 5 + 4 * 16
