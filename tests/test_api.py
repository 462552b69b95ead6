"""The Batch API end to end: the official openai client (strict response validation) against a live uvicorn
server on a loopback port, real Redis, a real SQLite store and real worker processes on the tiny model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletion

from omlx_jobs.api import ServeConfig
from omlx_jobs.jobs.queue import queue_name
from omlx_jobs.store import open_store
from tests.api_harness import Clock, chat_line, live_server, openai_client, write_lines

KEY = "test-key-123456"
CHAT = "/v1/chat/completions"


class Env:
    """One store, one Redis db, the server's config and worker processes on the tiny model."""

    def __init__(self, tmp: Path, redis_url: str, model: Path) -> None:
        self.tmp, self.redis_url, self.model = tmp, redis_url, model
        self.db = tmp / "jobs.db"
        self.clock = Clock()
        self.workers: list[subprocess.Popen[bytes]] = []
        self.env = {
            **os.environ,
            "OMLX_JOBS_DB": str(self.db),
            "OMLX_JOBS_REDIS_URL": redis_url,
            "OMLX_JOBS_HOME": str(tmp / "home"),
        }
        self.env.pop("OMLX_JOBS_DATABASE_URL", None)
        self._store: Any = None

    def config(self, **kw: Any) -> ServeConfig:
        base: dict[str, Any] = {
            "db_url": f"sqlite:///{self.db}",
            "redis_url": self.redis_url,
            "files_dir": self.tmp / "files",
            "api_keys": (KEY,),
            "models": {"tiny": str(self.model)},
            "clock": self.clock,
            "sweep_seconds": 0.5,
        }
        return ServeConfig(**{**base, **kw})

    @property
    def store(self) -> Any:
        if self._store is None:
            self._store = open_store(db_path=self.db)
        return self._store

    def worker(self, *extra: str, burst: bool = True) -> subprocess.Popen[bytes]:
        log = (self.tmp / f"worker-{len(self.workers)}.log").open("wb")
        cmd = [sys.executable, "-m", "omlx_jobs.cli", "worker", "--model", str(self.model), *extra]
        proc = subprocess.Popen([*cmd, *(["--burst"] if burst else [])], env=self.env, stdout=log, stderr=log)
        self.workers.append(proc)
        return proc

    def logs(self) -> str:
        return "\n".join(p.read_text()[-3000:] for p in sorted(self.tmp.glob("worker-*.log")))

    def close(self) -> None:
        for proc in self.workers:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        if self._store is not None:
            self._store.close()


@pytest.fixture
def env(tmp_path: Path, redis_url: str, tiny_model_dir: Path) -> Iterator[Env]:
    e = Env(tmp_path, redis_url, tiny_model_dir)
    yield e
    e.close()


@pytest.fixture
def server(env: Env) -> Iterator[str]:
    with live_server(env.config()) as url:
        yield url


def wait_for(what: str, cond: Callable[[], Any], timeout: float = 120, poll: float = 0.1, logs: str = "") -> Any:
    deadline = time.monotonic() + timeout
    while not (value := cond()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}\n{logs}")
        time.sleep(poll)
    return value


def upload(client: Any, path: Path) -> Any:
    with path.open("rb") as fh:
        return client.files.create(file=fh, purpose="batch")


def create(client: Any, file_id: str, **kw: Any) -> Any:
    return client.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h", **kw)


def jsonl(text: str) -> list[dict[str, Any]]:
    return [json.loads(x) for x in text.splitlines()]


def test_upload_create_run_and_download_results(env: Env, server: str) -> None:
    client = openai_client(server)
    lines: list[Any] = [chat_line(i) for i in range(12)]
    long = chat_line(99)
    long["body"]["messages"][1]["content"] = "word " * 900  # past the tiny model's 512-token context
    lines.insert(5, long)
    src = write_lines(env.tmp / "in.jsonl", lines)

    f = upload(client, src)
    assert (f.purpose, f.bytes, f.filename, f.status) == ("batch", src.stat().st_size, "in.jsonl", "processed")
    assert client.files.retrieve(f.id).id == f.id
    assert client.files.content(f.id).content == src.read_bytes()

    batch = create(client, f.id, metadata={"project": "test"})
    assert batch.status == "in_progress" and batch.model == "tiny" and batch.metadata == {"project": "test"}
    assert batch.output_file_id is None and batch.error_file_id is None  # null, never "", until finalized
    assert batch.request_counts is not None and batch.request_counts.total == 13
    assert batch.expires_at == batch.created_at + 24 * 3600 and batch.in_progress_at is not None

    proc = env.worker()
    assert proc.wait(timeout=300) == 0, env.logs()
    done = wait_for("completed", lambda: (b := client.batches.retrieve(batch.id)).status == "completed" and b)
    assert done.request_counts is not None and done.usage is not None
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (13, 12, 1)
    assert done.usage.input_tokens > 0 and done.usage.output_tokens > 0
    assert 0 < done.usage.input_tokens_details.cached_tokens < done.usage.input_tokens  # the shared system prompt
    assert done.usage.total_tokens == done.usage.input_tokens + done.usage.output_tokens
    assert done.completed_at and done.finalizing_at and done.completed_at >= done.in_progress_at  # type: ignore[operator]
    assert done.output_file_id and done.error_file_id and done.output_file_id != done.error_file_id

    out = client.files.content(done.output_file_id).content
    results = jsonl(out.decode())
    assert [r["custom_id"] for r in results] == [f"req-{i}" for i in range(12)]  # input order
    for r in results:
        assert r["error"] is None and r["response"]["status_code"] == 200
        ChatCompletion.model_validate(r["response"]["body"])
        assert r["id"].startswith(f"batch_req_{batch.id}_")
    errors = jsonl(client.files.content(done.error_file_id).text)
    assert [e["custom_id"] for e in errors] == ["req-99"]
    assert errors[0]["response"]["status_code"] == 400
    assert errors[0]["response"]["body"]["error"]["code"] == "context_length_exceeded"

    out_file = client.files.retrieve(done.output_file_id)
    assert (out_file.purpose, out_file.bytes) == ("batch_output", len(out))
    err_file = client.files.retrieve(done.error_file_id)  # measured on demand, not downloaded yet by retrieve
    assert err_file.bytes == len(client.files.content(done.error_file_id).content)
    again = client.batches.retrieve(batch.id)
    assert (again.output_file_id, again.error_file_id) == (done.output_file_id, done.error_file_id)
    with pytest.raises(openai.BadRequestError) as exc:  # 400, not 409: the client retries 409
        client.batches.cancel(batch.id)
    assert exc.value.status_code == 400 and "completed" in str(exc.value)


def test_lists_page_with_the_clients_cursor(env: Env, server: str) -> None:
    client = openai_client(server)
    src = write_lines(env.tmp / "in.jsonl", [chat_line(i) for i in range(3)])
    file_ids = [upload(client, src).id for _ in range(7)]
    batch_ids = [create(client, file_ids[i]).id for i in range(5)]

    page = client.files.list(limit=2)
    assert len(page.data) == 2 and page.has_more
    seen = [f.id for f in page]  # the client follows after=data[-1].id until has_more is false
    assert seen == list(reversed(file_ids))  # newest first
    pages = 0
    current: Any = page
    while current is not None:
        pages += 1
        current = current.get_next_page() if current.has_next_page() else None
    assert pages == 4
    assert [f.id for f in client.files.list(limit=3, order="asc")] == file_ids
    assert [f.id for f in client.files.list(purpose="batch_output")] == []

    assert [b.id for b in client.batches.list(limit=2)] == list(reversed(batch_ids))
    assert [b.id for b in client.batches.list(limit=100)] == list(reversed(batch_ids))
    # A cursor whose file was deleted still works: ids sort by creation time.
    assert client.files.delete(file_ids[3]).deleted
    after = [f.id for f in client.files.list(after=file_ids[3], order="asc")]
    assert after == file_ids[4:]
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(file_ids[3])


def test_cancel_keeps_finished_results(env: Env, tiny_model_dir: Path) -> None:
    # No alias: the model is accepted because a live worker serves it (its queue omlx:<model>).
    config = env.config(models={})
    with live_server(config) as url:
        client = openai_client(url)
        lines = [chat_line(i, model=str(tiny_model_dir), max_tokens=200) for i in range(120)]
        f = upload(client, write_lines(env.tmp / "in.jsonl", lines))
        with pytest.raises(openai.BadRequestError) as exc:
            create(client, f.id)  # nothing serves it yet: an error now, not a batch that never starts
        assert exc.value.status_code == 400 and "not served" in str(exc.value) and "line 1" in str(exc.value)

        env.worker("--batch-size", "1", burst=False)
        from omlx_jobs.jobs.queue import connect
        from omlx_jobs.jobs.workers import served_models

        wait_for("the worker", lambda: str(tiny_model_dir) in served_models(connect(env.redis_url)), logs=env.logs())
        batch = create(client, f.id)
        wait_for("3 results", lambda: env.store.counts(batch.id).completed >= 3, logs=env.logs(), poll=0.02)
        cancelling = client.batches.cancel(batch.id)
        assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at is not None
        done = wait_for("cancelled", lambda: (b := client.batches.retrieve(batch.id)).status == "cancelled" and b)
        counts = env.store.counts(batch.id)
        assert 3 <= counts.completed < 120 and counts.completed + counts.cancelled == 120 and counts.pending == 0
        assert done.request_counts.completed == counts.completed and done.cancelled_at is not None
        results = jsonl(client.files.content(done.output_file_id).text)
        assert len(results) == counts.completed and all(r["response"]["status_code"] == 200 for r in results)
        errors = jsonl(client.files.content(done.error_file_id).text)
        assert len(errors) == counts.cancelled and {e["error"]["code"] for e in errors} == {"batch_cancelled"}
        with pytest.raises(openai.BadRequestError):
            client.batches.cancel(batch.id)


def test_a_file_with_bad_lines_makes_a_failed_batch_with_line_numbers(env: Env, server: str) -> None:
    client = openai_client(server)
    bad_temperature = chat_line(3, temperature=9)
    src = write_lines(env.tmp / "bad.jsonl", [chat_line(0), "{not json", chat_line(2), bad_temperature])
    f = upload(client, src)  # accepted as a file, as OpenAI does; the batch fails validation
    batch = create(client, f.id)
    assert batch.status == "failed" and batch.failed_at is not None and batch.in_progress_at is None
    assert batch.errors is not None and batch.errors.data is not None
    by_line = {e.line: e for e in batch.errors.data}
    assert sorted(by_line) == [2, 4]
    assert by_line[2].code == "invalid_json" and "JSON" in (by_line[2].message or "")
    assert by_line[4].code == "out_of_range" and by_line[4].param == "body.temperature"
    assert batch.request_counts is not None and batch.request_counts.total == 0
    assert batch.output_file_id is None and batch.error_file_id is None
    assert client.batches.retrieve(batch.id).status == "failed"


def test_auth_not_found_and_upload_errors(env: Env, tiny_model_dir: Path) -> None:
    import httpx2 as httpx

    config = env.config(max_upload_bytes=4096, max_upload_lines=5)
    with live_server(config) as url:
        client = openai_client(url)
        with pytest.raises(openai.AuthenticationError) as auth:
            openai_client(url, api_key="wrong-key-000000").files.list()
        assert auth.value.status_code == 401 and auth.value.code == "invalid_api_key"
        assert httpx.get(f"{url}/v1/batches").status_code == 401
        assert httpx.get(f"{url}/metrics").status_code == 401
        assert httpx.get(f"{url}/healthz").status_code == 200  # public, and the page's static files too

        for call in (
            lambda: client.batches.retrieve("batch_0000000000000000000000ff"),
            lambda: client.files.retrieve("file-0000000000000000000000ff"),
            lambda: client.files.content("..%2F..%2Fjobs.db"),
            lambda: client.files.delete("file-../../jobs.db"),
        ):
            with pytest.raises(openai.NotFoundError) as nf:
                call()
            assert nf.value.status_code == 404 and nf.value.body["type"] == "invalid_request_error"  # type: ignore[index]
        headers = {"Authorization": f"Bearer {KEY}"}
        traversal = httpx.get(f"{url}/v1/files/..%2F..%2Fjobs.db/content", headers=headers)
        assert traversal.status_code == 404 and "error" in traversal.json()

        small = write_lines(env.tmp / "small.jsonl", [chat_line(i) for i in range(2)])
        with small.open("rb") as fh, pytest.raises(openai.BadRequestError) as purpose:
            client.files.create(file=fh, purpose="fine-tune")
        assert purpose.value.body["param"] == "purpose" and "purpose=batch" in purpose.value.message  # type: ignore[index]
        big = write_lines(env.tmp / "big.jsonl", [chat_line(i) for i in range(40)])
        with big.open("rb") as fh, pytest.raises(openai.APIStatusError) as too_big:
            client.files.create(file=fh, purpose="batch")
        assert too_big.value.status_code == 413 and too_big.value.body["code"] == "file_too_large"  # type: ignore[index]
        many = write_lines(env.tmp / "many.jsonl", [{"prompt": "x"}] * 8)
        with many.open("rb") as fh, pytest.raises(openai.APIStatusError) as too_many:
            client.files.create(file=fh, purpose="batch")
        assert too_many.value.status_code == 413 and too_many.value.body["code"] == "too_many_lines"  # type: ignore[index]
        assert sorted(p.name for p in (env.tmp / "files").iterdir()) == []  # nothing left of the refused uploads

        f = upload(client, small)
        with pytest.raises(openai.BadRequestError) as window:
            client.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="1h")  # type: ignore[arg-type]
        assert window.value.body["param"] == "completion_window"  # type: ignore[index]
        with pytest.raises(openai.BadRequestError) as endpoint:
            client.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h")
        assert endpoint.value.body["param"] == "endpoint"  # type: ignore[index]
        with pytest.raises(openai.NotFoundError):
            create(client, "file-0000000000000000000000ff")
        unknown = upload(client, write_lines(env.tmp / "unknown.jsonl", [chat_line(0, model="gpt-4o")]))
        with pytest.raises(openai.BadRequestError) as model:
            create(client, unknown.id)
        assert model.value.code == "model_not_found" and "'gpt-4o'" in model.value.message
        mixed = upload(client, write_lines(env.tmp / "mixed.jsonl", [chat_line(0), chat_line(1, model="other")]))
        with pytest.raises(openai.BadRequestError) as two:
            create(client, mixed.id)
        assert two.value.code == "mixed_models" and "line 2" in two.value.message
        wrong_url = {**chat_line(0), "url": "/v1/completions", "body": {"model": "tiny", "prompt": "hi"}}
        mismatch = upload(client, write_lines(env.tmp / "url.jsonl", [chat_line(1), wrong_url]))
        with pytest.raises(openai.BadRequestError) as url_error:
            create(client, mismatch.id)
        assert url_error.value.code == "endpoint_mismatch" and "line 2" in url_error.value.message

        not_json = httpx.post(f"{url}/v1/batches", headers=headers, content=b"{nope")
        assert not_json.status_code == 422 and not_json.json()["error"]["message"].startswith("the request body")
        not_form = httpx.post(f"{url}/v1/files", headers=headers, content=b"plain")
        assert not_form.status_code == 422
        wrong_method = httpx.put(f"{url}/v1/batches", headers=headers)
        assert wrong_method.status_code == 405 and "error" in wrong_method.json()
        assert httpx.get(f"{url}/v2/nothing", headers=headers).json()["error"]["message"].startswith("no route")
        # A write from another site's page is refused even with a key in hand.
        evil = httpx.post(
            f"{url}/v1/batches/{f.id}/cancel", headers={**headers, "Origin": "http://evil.example"}, content=b""
        )
        assert evil.status_code == 403 and evil.json()["error"]["code"] == "cross_origin_request"


def test_a_keyless_server_answers_only_loopback_host_names(env: Env) -> None:
    import httpx2 as httpx

    with live_server(env.config(api_keys=())) as url:
        assert httpx.get(f"{url}/v1/files").status_code == 200
        rebound = httpx.get(f"{url}/v1/files", headers={"Host": "attacker.example:8000"})
        assert rebound.status_code == 403 and rebound.json()["error"]["code"] == "host_not_allowed"
        form = httpx.post(f"{url}/v1/files", headers={"Origin": "http://attacker.example"}, content=b"")
        assert form.status_code == 403


def test_the_completion_window_expires_a_batch_and_keeps_finished_results(env: Env, server: str) -> None:
    client = openai_client(server)
    f = upload(client, write_lines(env.tmp / "in.jsonl", [chat_line(i) for i in range(6)]))
    batch = create(client, f.id)
    rows = list(env.store.iter_requests(batch.id, columns=["id", "custom_id"]))
    for row in rows[:2]:  # two requests finished, as a worker would have recorded them
        env.store.record_completion(
            row.id, output_text="done", finish_reason="stop", prompt_tokens=5, cached_tokens=0, completion_tokens=1
        )
    env.clock.advance(24 * 3600 - 60)
    assert client.batches.retrieve(batch.id).status == "in_progress"
    env.clock.advance(61)
    expired = client.batches.retrieve(batch.id)
    assert expired.status == "expired" and expired.expired_at is not None and expired.expired_at >= expired.expires_at  # type: ignore[operator]
    assert expired.request_counts is not None and expired.request_counts.completed == 2
    kept = jsonl(client.files.content(expired.output_file_id).text)  # type: ignore[arg-type]
    assert [r["custom_id"] for r in kept] == ["req-0", "req-1"]
    lost = jsonl(client.files.content(expired.error_file_id).text)  # type: ignore[arg-type]
    assert [e["custom_id"] for e in lost] == [f"req-{i}" for i in range(2, 6)]
    assert {e["error"]["code"] for e in lost} == {"batch_expired"} and all(e["response"] is None for e in lost)
    with pytest.raises(openai.BadRequestError):
        client.batches.cancel(batch.id)
    proc = env.worker()  # the shard left in the queue (if any) does nothing
    assert proc.wait(timeout=300) == 0, env.logs()
    assert env.store.counts(batch.id).completed == 2


def test_expiry_stops_a_running_shard(env: Env, server: str) -> None:
    client = openai_client(server)
    f = upload(client, write_lines(env.tmp / "in.jsonl", [chat_line(i, max_tokens=200) for i in range(120)]))
    batch = create(client, f.id)
    env.worker("--batch-size", "1", burst=False)
    wait_for("3 results", lambda: env.store.counts(batch.id).completed >= 3, logs=env.logs(), poll=0.02)
    env.clock.advance(24 * 3600 + 1)
    assert client.batches.retrieve(batch.id).status == "expired"
    from omlx_jobs.jobs.queue import connect
    from omlx_jobs.jobs.workers import list_workers

    redis = connect(env.redis_url)
    wait_for("the worker to stop the shard", lambda: all(w.state == "idle" for w in list_workers(redis)), timeout=30)
    counts = env.store.counts(batch.id)
    assert counts.pending == 0 and 3 <= counts.completed < 120
    time.sleep(1.5)
    assert env.store.counts(batch.id).completed == counts.completed  # nothing runs after the expiry
    assert client.batches.retrieve(batch.id).request_counts.completed == counts.completed  # type: ignore[union-attr]


def test_metrics_parse_with_prometheus_client(env: Env, server: str) -> None:
    import httpx2 as httpx
    from prometheus_client.parser import text_string_to_metric_families

    client = openai_client(server)
    f = upload(client, write_lines(env.tmp / "in.jsonl", [chat_line(i) for i in range(4)]))
    batch = create(client, f.id)
    row = next(iter(env.store.iter_requests(batch.id, columns=["id"])))
    env.store.record_completion(
        row.id, output_text="x", finish_reason="stop", prompt_tokens=30, cached_tokens=20, completion_tokens=3
    )
    text = httpx.get(f"{server}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    families = {fam.name: fam for fam in text_string_to_metric_families(text)}
    value = {(s.name, tuple(sorted(s.labels.items()))): s.value for fam in families.values() for s in fam.samples}
    assert value[("omlx_requests_completed_total", ())] == 1
    assert value[("omlx_requests_pending", ())] == 3
    assert value[("omlx_queue_depth", (("queue", queue_name(str(env.model))),))] == 1
    assert value[("omlx_finished_tokens_per_second", (("kind", "prompt"),))] == pytest.approx(30 / 60)
    assert value[("omlx_cached_prompt_tokens_ratio", ())] == pytest.approx(20 / 30)
    assert value[("omlx_workers_alive", (("state", "idle"),))] == 0
    assert value[("omlx_jobs", (("status", "in_progress"),))] == 1
    assert families["omlx_requests_completed"].type == "counter"
    assert "omlx_prefix_cache_hit_ratio" in families and value[("omlx_redis_up", ())] == 1


def test_housekeeping_settles_ended_jobs_and_deletes_expired_files(env: Env, server: str) -> None:
    client = openai_client(server)
    src = write_lines(env.tmp / "in.jsonl", [chat_line(i) for i in range(3)])
    with src.open("rb") as fh:
        short = client.files.create(file=fh, purpose="batch", expires_after={"anchor": "created_at", "seconds": 3600})
    assert short.expires_at == short.created_at + 3600
    batch = create(client, short.id, output_expires_after={"anchor": "created_at", "seconds": 7200})
    for row in env.store.iter_requests(
        batch.id, columns=["id"]
    ):  # results committed, the worker gone before finalizing
        env.store.record_completion(
            row.id, output_text="x", finish_reason="stop", prompt_tokens=3, cached_tokens=0, completion_tokens=1
        )
    done = wait_for(
        "the sweep to complete the job", lambda: (b := client.batches.retrieve(batch.id)).status == "completed" and b
    )
    output = client.files.retrieve(done.output_file_id)  # type: ignore[arg-type]
    assert output.expires_at is not None and output.expires_at - output.created_at == 7200
    assert done.error_file_id is None  # nothing failed: no error file
    stored = env.tmp / "files" / f"{short.id}.jsonl"
    assert stored.read_bytes() == src.read_bytes() and oct(stored.stat().st_mode & 0o777) == "0o600"
    env.clock.advance(3601)
    wait_for("the input file to expire", lambda: not stored.exists(), timeout=20)
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(short.id)
    assert len(jsonl(client.files.content(done.output_file_id).text)) == 3  # type: ignore[arg-type]
    env.clock.advance(3600)
    wait_for(
        "the output file to expire", lambda: not [f for f in client.files.list(purpose="batch_output")], timeout=20
    )
