"""The main path end to end: CLI submit to a real Redis, a real burst worker process on the tiny model,
status, results in OpenAI batch format; rejection of bad files; --skip-invalid; a prompt over the context."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from omlx_jobs.cli import cli

SYSTEM = "You are a helpful assistant. Answer briefly and clearly, in one sentence please."


def write_mixed(path: Path, n: int = 50) -> list[tuple[str, str]]:
    """Lines cycling chat (OpenAI format), completion (OpenAI format), chat (shorthand); (custom_id, object)."""
    ids = []
    with path.open("w") as f:
        for i in range(n):
            if i % 3 == 0:
                line = {
                    "custom_id": f"chat-{i}",
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": {
                        "model": "m",
                        "max_tokens": 6,
                        "temperature": 0,
                        "messages": [
                            {"role": "system", "content": SYSTEM},
                            {"role": "user", "content": f"question {i}"},
                        ],
                    },
                }
            elif i % 3 == 1:
                line = {
                    "custom_id": f"cmpl-{i}",
                    "method": "POST",
                    "url": "/v1/completions",
                    "body": {"prompt": f"Once upon a time {i}", "max_tokens": 5, "temperature": 0.8, "seed": i},
                }
            else:
                line = {"messages": [{"role": "user", "content": f"shorthand {i}"}], "max_tokens": 4, "stop": ["\n\n"]}
            kind = "text_completion" if i % 3 == 1 else "chat.completion"
            ids.append((line.get("custom_id", str(i + 1)), kind))
            f.write(json.dumps(line) + "\n")
    return ids


@pytest.fixture
def env(tmp_path: Path, redis_url: str) -> dict[str, str]:
    e = dict(os.environ)
    e.update(
        {
            "OMLX_JOBS_DB": str(tmp_path / "jobs.db"),
            "OMLX_JOBS_REDIS_URL": redis_url,
            "OMLX_JOBS_HOME": str(tmp_path / "home"),
        }
    )
    e.pop("OMLX_JOBS_DATABASE_URL", None)
    return e


def invoke(env: dict[str, str], *args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, list(args), env=env, catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


def burst_worker(env: dict[str, str], model: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "omlx_jobs.cli", "worker", "--model", str(model), "--burst", *extra],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_submit_worker_status_results(tmp_path: Path, env: dict[str, str], tiny_model_dir: Path) -> None:
    ids = write_mixed(tmp_path / "in.jsonl")
    code, out, err = invoke(env, "submit", str(tmp_path / "in.jsonl"), "--model", str(tiny_model_dir))
    assert code == 0, err
    job = out.strip()
    assert job.startswith("batch_")
    code, out, _ = invoke(env, "status", job, "--json")
    assert json.loads(out)["status"] == "in_progress"

    proc = burst_worker(env, tiny_model_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]

    code, out, _ = invoke(env, "status", job, "--json")
    status = json.loads(out)
    assert status["status"] == "completed"
    assert status["request_counts"] == {"total": 50, "completed": 50, "failed": 0, "cancelled": 0, "pending": 0}
    assert status["usage"]["completion_tokens"] > 0
    assert status["prefix"]["trie_min_tokens"] > 0 and status["usage"]["prompt_tokens_details"]["cached_tokens"] > 0

    code, out, err = invoke(env, "results", job, "-o", str(tmp_path / "out.jsonl"))
    assert code == 0, err
    lines = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [(x["custom_id"], x["response"]["body"]["object"]) for x in lines] == ids  # input order
    for x in lines:
        assert x["error"] is None and x["response"]["status_code"] == 200
        body = x["response"]["body"]
        usage = body["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        assert "cached_tokens" in usage["prompt_tokens_details"]
        assert body["choices"][0]["finish_reason"] in ("stop", "length")
    # The shared system prompt was computed once: later chat lines report cached tokens.
    assert sum(x["response"]["body"]["usage"]["prompt_tokens_details"]["cached_tokens"] for x in lines) > 0

    # `results -o` refuses to overwrite unless --force.
    code, _, err = invoke(env, "results", job, "-o", str(tmp_path / "out.jsonl"))
    assert code != 0 and "--force" in err
    code, _, _ = invoke(env, "results", job, "-o", str(tmp_path / "out.jsonl"), "--force")
    assert code == 0
    code, out, _ = invoke(env, "jobs")
    assert job in out and "completed" in out


def test_bad_file_is_rejected_and_skip_invalid_runs_the_rest(
    tmp_path: Path, env: dict[str, str], tiny_model_dir: Path
) -> None:
    src = tmp_path / "bad.jsonl"
    src.write_text(
        json.dumps({"prompt": "fine", "max_tokens": 3})
        + "\n"
        + "{not json\n"
        + json.dumps({"custom_id": "x", "method": "GET", "url": "/v1/completions", "body": {"prompt": "a"}})
        + "\n"
        + json.dumps({"prompt": "fine too", "temperature": 9})
        + "\n"
        + json.dumps({"prompt": "x" * 4000, "max_tokens": 3})
        + "\n"  # over the tiny model's 512-token context
    )
    code, out, err = invoke(env, "submit", str(src), "--model", str(tiny_model_dir))
    assert code == 2 and out == ""
    assert "line 2" in err and "invalid JSON" in err
    assert "line 3" in err and "'method'" in err
    assert "line 4" in err and "'temperature'" in err
    assert "nothing was queued" in err
    import redis

    assert redis.Redis.from_url(env["OMLX_JOBS_REDIS_URL"]).keys("rq:job:*") == []

    code, out, err = invoke(env, "submit", str(src), "--model", str(tiny_model_dir), "--skip-invalid")
    assert code == 0, err
    job = out.strip()
    proc = burst_worker(env, tiny_model_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    code, out, _ = invoke(env, "status", job, "--json")
    status = json.loads(out)
    assert status["status"] == "completed"  # one bad request never fails its job
    assert status["request_counts"]["completed"] == 1 and status["request_counts"]["failed"] == 4
    code, _, err = invoke(
        env, "results", job, "-o", str(tmp_path / "ok.jsonl"), "--errors", str(tmp_path / "err.jsonl")
    )
    assert code == 0, err
    ok = [json.loads(x) for x in (tmp_path / "ok.jsonl").read_text().splitlines()]
    bad = [json.loads(x) for x in (tmp_path / "err.jsonl").read_text().splitlines()]
    assert [x["custom_id"] for x in ok] == ["1"]
    codes = {x["custom_id"]: x["response"]["body"]["error"]["code"] for x in bad}
    assert codes["5"] == "context_length_exceeded"
    assert len(bad) == 4 and all(x["response"]["status_code"] == 400 for x in bad)


def test_redis_down_fails_clearly_and_stores_nothing(tmp_path: Path, env: dict[str, str]) -> None:
    (tmp_path / "in.jsonl").write_text(json.dumps({"prompt": "hi"}) + "\n")
    env = {**env, "OMLX_JOBS_REDIS_URL": "redis://:secret@127.0.0.1:1/0"}
    code, out, err = invoke(env, "submit", str(tmp_path / "in.jsonl"), "--model", "m")
    assert code == 1 and out == ""
    assert "cannot reach Redis at redis://:***@127.0.0.1:1/0" in err and "secret" not in err
    code, out, _ = invoke(env, "jobs")
    assert "no jobs yet" in out


def test_run_locally_without_redis(tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_mixed(tmp_path / "in.jsonl", 12)
    env = {"OMLX_JOBS_DB": str(tmp_path / "jobs.db"), "OMLX_JOBS_REDIS_URL": "redis://127.0.0.1:1/0"}
    code, _, err = invoke(
        env, "run", str(tmp_path / "in.jsonl"), "--model", str(tiny_model_dir), "-o", str(tmp_path / "out.jsonl")
    )
    assert code == 0, err
    lines = (tmp_path / "out.jsonl").read_text().splitlines()
    assert len(lines) == 12 and all(json.loads(x)["response"]["status_code"] == 200 for x in lines)


def test_cancel_a_queued_job_keeps_counts_consistent(tmp_path: Path, env: dict[str, str], tiny_model_dir: Path) -> None:
    write_mixed(tmp_path / "in.jsonl", 9)
    code, out, _ = invoke(env, "submit", str(tmp_path / "in.jsonl"), "--model", str(tiny_model_dir))
    job = out.strip()
    code, out, _ = invoke(env, "cancel", job)
    assert code == 0 and "cancelled" in out
    code, out, _ = invoke(env, "status", job, "--json")
    status = json.loads(out)
    assert status["status"] == "cancelled"
    assert status["request_counts"]["cancelled"] == 9
    proc = burst_worker(env, tiny_model_dir)  # the dropped shard does not run
    assert proc.returncode == 0
    code, out, _ = invoke(env, "status", job, "--json")
    assert json.loads(out)["request_counts"]["completed"] == 0


def test_help_explains_every_command() -> None:
    result = CliRunner().invoke(cli, ["--help"])
    for name in ("submit", "status", "results", "cancel", "retry", "resume", "jobs", "worker", "run"):
        assert name in result.output
    result = CliRunner().invoke(cli, ["submit", "--help"])
    assert "--skip-invalid" in result.output and "--wait" in result.output
    assert "--priority" in result.output and "--allow-files-from" in result.output
    for command in ("submit", "run", "worker"):
        out = " ".join(CliRunner().invoke(cli, [command, "--help"]).output.split())
        assert "--allow-files-from DIR" in out and "--allow-remote-images" in out, command
    worker = " ".join(CliRunner().invoke(cli, ["worker", "--help"]).output.split())
    assert ":high and :low queues, high first" in worker, "a worker serves every priority of its queue"


def test_submit_wait_returns_when_a_worker_finishes(tmp_path: Path, env: dict[str, str], tiny_model_dir: Path) -> None:
    write_mixed(tmp_path / "in.jsonl", 6)
    worker = subprocess.Popen(
        [sys.executable, "-m", "omlx_jobs.cli", "worker", "--model", str(tiny_model_dir)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        code, out, err = invoke(env, "submit", str(tmp_path / "in.jsonl"), "--model", str(tiny_model_dir), "--wait")
        assert code == 0, err
        job = out.strip()
        assert f"{job}: completed" in err
        code, out, _ = invoke(env, "status", job, "--json")
        assert json.loads(out)["request_counts"]["completed"] == 6
    finally:
        worker.terminate()  # SIGTERM: an idle worker exits at once
        assert worker.wait(timeout=60) == 0, worker.stderr.read()[-2000:] if worker.stderr else ""


def test_run_reports_an_engine_fault_in_one_line(tmp_path: Path, tiny_model_dir: Path, monkeypatch: Any) -> None:
    """A fault inside the engine (a bug of ours) ends `run` with one line naming it and --resume, not a traceback."""
    from omlx_jobs.worker.runtime import shard

    def broken(*args: Any, **kw: Any) -> None:
        raise AttributeError("'SerialEngine' object has no attribute 'outputs'")

    monkeypatch.setattr(shard, "run_shard", broken)
    write_mixed(tmp_path / "in.jsonl", 2)
    env = {"OMLX_JOBS_DB": str(tmp_path / "jobs.db"), "OMLX_JOBS_HOME": str(tmp_path / "home")}
    args = ["run", str(tmp_path / "in.jsonl"), "-m", str(tiny_model_dir), "-o", str(tmp_path / "out.jsonl")]
    result = CliRunner().invoke(cli, args, env=env)
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit)
    assert (
        "error: the engine failed (AttributeError: 'SerialEngine'" in result.stderr
        and "--resume batch_" in result.stderr
    )
