"""A submit killed with -9 leaves a job that reconcile and `resume` recognise as dead and fail, saying so (issue
21, 15); a slow submit that is alive keeps its job; a stalled one whose job was failed never queues it. Real
processes, a real Redis and SQLite. Also: submit refuses an empty --model (issue 21, 21)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from redis import Redis

from omlx_jobs.jobs import actions, lifecycle
from omlx_jobs.jobs.lease import INTERRUPTED_MESSAGE, SubmitLost
from omlx_jobs.jobs.queue import queue_name
from omlx_jobs.jobs.submit import BadSubmit, check_model, load_job
from omlx_jobs.store import open_store

MODEL = "tiny"
QUEUE = queue_name(MODEL)


def _file(path: Path, lines: int) -> Path:
    with path.open("w") as fh:
        for i in range(lines):
            fh.write(json.dumps({"custom_id": f"r{i}", "prompt": f"Tell me about {i}.", "max_tokens": 4}) + "\n")
    return path


def _killed_submit(tmp_path: Path, sqlite_url: str, redis_url: str, lease: float) -> str:
    """Run `actions.submit` in a child process that stalls after its first stored chunk; kill -9 it there."""
    src = _file(tmp_path / "in.jsonl", 6000)
    script = textwrap.dedent(
        f"""
        import pathlib, time
        from redis import Redis
        from omlx_jobs.jobs import actions
        from omlx_jobs.store import open_store

        def progress(n):
            if n:
                print("stored", n, flush=True)
                time.sleep(60)  # killed here, mid-file

        actions.submit(open_store(url={sqlite_url!r}), Redis.from_url({redis_url!r}), pathlib.Path({str(src)!r}),
                       {MODEL!r},
                       job_id="batch_killed", lease_seconds={lease}, on_progress=progress)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert line.startswith("stored"), proc.stderr.read()  # type: ignore[union-attr]
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    return "batch_killed"


def test_reconcile_fails_the_job_of_a_killed_submit(tmp_path: Path, store_url: str, redis_url: str) -> None:
    job_id = _killed_submit(tmp_path, store_url, redis_url, lease=1.0)
    store, redis = open_store(url=store_url), Redis.from_url(redis_url)
    try:
        job = store.get_job(job_id)
        assert (
            job.status == lifecycle.VALIDATING
        )  # killed mid-file (on PostgreSQL its writer thread may not have stored a chunk yet)
        assert actions.reconcile(store, redis, QUEUE).failed_submits == []  # its lease has not passed yet
        time.sleep(1.2)
        assert actions.reconcile(store, redis, QUEUE).failed_submits == [job_id]
        job = store.get_job(job_id)
        assert job.status == lifecycle.FAILED and job.errors and job.errors[0]["message"] == INTERRUPTED_MESSAGE
        assert store.counts(job_id).total == 0  # what the dead submit stored is dropped
        with pytest.raises(ValueError, match="failed at submit: the submit stopped"):
            actions.resume(store, redis, job_id)
    finally:
        store.close()
        redis.close()


def test_resume_says_what_it_found(tmp_path: Path, sqlite_url: str, redis_url: str) -> None:
    job_id = _killed_submit(tmp_path, sqlite_url, redis_url, lease=30.0)
    store, redis = open_store(url=sqlite_url), Redis.from_url(redis_url)
    try:
        with pytest.raises(actions.JobBusy, match="still being submitted"):  # the lease holds: it may be alive
            actions.resume(store, redis, job_id)
        store.update_job(job_id, submit_lease_until=time.time() - 1)  # 30 s later
        with pytest.raises(ValueError, match=r"submit stopped before the whole file was stored \(\d+ request"):
            actions.resume(store, redis, job_id)
        assert store.get_job(job_id).status == lifecycle.FAILED
    finally:
        store.close()
        redis.close()


def test_a_slow_submit_that_is_alive_keeps_its_job(tmp_path: Path, sqlite_url: str, redis_url: str) -> None:
    src = _file(tmp_path / "in.jsonl", 8000)
    store, redis = open_store(url=sqlite_url), Redis.from_url(redis_url)
    errors: list[BaseException] = []

    def submit() -> None:
        try:
            actions.submit(store, redis, src, MODEL, job_id="batch_slow", lease_seconds=2.0,
                           on_progress=lambda n: time.sleep(0.6))  # fmt: skip
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=submit)
    started = time.monotonic()
    thread.start()
    try:
        while thread.is_alive():  # a worker reconciling all along
            assert actions.reconcile(store, redis, QUEUE).failed_submits == []
            time.sleep(0.05)
        thread.join()
        assert errors == []
        job = store.get_job("batch_slow")
        assert (job.status, job.total, job.submit_lease_until) == (lifecycle.IN_PROGRESS, 8000, None)
        assert time.monotonic() - started > 2.0, "the submit outlived its first lease: it renewed it"
    finally:
        store.close()
        redis.close()


def test_a_stalled_submit_whose_job_was_failed_queues_nothing(tmp_path: Path, sqlite_url: str) -> None:
    src = _file(tmp_path / "in.jsonl", 5000)
    store = open_store(url=sqlite_url)

    def stall(n: int) -> None:
        if n == 2000:  # stalled past its lease; meanwhile a worker takes it for dead
            time.sleep(0.5)
            assert actions.fail_interrupted(store, "batch_stalled") is not None

    try:
        with pytest.raises(SubmitLost, match="was failed while this submit was stalled"):
            load_job(store, src, MODEL, job_id="batch_stalled", lease_seconds=0.2, on_progress=stall)
        assert [j.id for j in store.list_jobs()] == []  # nothing half-made is left
    finally:
        store.close()


def test_an_empty_model_is_refused(tmp_path: Path, sqlite_url: str, redis_url: str) -> None:
    from click.testing import CliRunner

    from omlx_jobs.cli import cli

    for model in ("", "   ", "a\nb", "x" * 1025):
        with pytest.raises(BadSubmit):
            check_model(model)
    assert check_model("gguf:/models/SmolLM2-135M-Instruct.Q4_1.gguf").startswith("gguf:")
    src = _file(tmp_path / "in.jsonl", 2)
    env = {"OMLX_JOBS_DATABASE_URL": sqlite_url, "OMLX_JOBS_REDIS_URL": redis_url}
    result = CliRunner().invoke(cli, ["submit", str(src), "--model", ""], env=env)
    assert result.exit_code != 0 and "--model is empty" in result.output
    store = open_store(url=sqlite_url)
    try:
        assert store.list_jobs() == []
    finally:
        store.close()
