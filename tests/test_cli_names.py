"""Short model names and keyed queues through the CLI, with real Redis and a real burst worker on the tiny model:
two spellings of one model meet on one queue, a job queued under the old queue name still runs, --model-name
shows in status, jobs and workers (paths only in status --json), cancel of an ended job says nothing was
cancelled, and `run --model-name`."""

from __future__ import annotations

import json
import os
from pathlib import Path

from omlx_jobs.jobs.queue import legacy_queue_name
from tests.test_cli_worker import burst_worker, env, invoke, write_mixed  # noqa: F401 - env is a fixture


def test_two_spellings_of_a_model_meet_on_one_queue(tmp_path: Path, env: dict[str, str], tiny_model_dir: Path) -> None:  # noqa: F811
    write_mixed(tmp_path / "in.jsonl", 9)
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "alias").symlink_to(tiny_model_dir)  # submit names the model through a link
    spelled = os.path.relpath(tmp_path / "models" / "alias" / ".." / "alias")
    code, out, err = invoke(env, "submit", str(tmp_path / "in.jsonl"), "--model", spelled, "--model-name", "named")
    assert code == 0, err
    job = out.strip()
    proc = burst_worker(env, tiny_model_dir)  # the worker spells it as its real path
    assert proc.returncode == 0, proc.stderr

    status = json.loads(invoke(env, "status", job, "--json")[1])
    assert status["status"] == "completed" and status["request_counts"]["completed"] == 9
    assert status["model_name"] == "named" and status["model"] == spelled
    assert status["live"]["generated_tokens"] > 0 and status["live"]["requests_in_flight"] == 0
    text = invoke(env, "status", job)[1]
    assert "model      named" in text and spelled not in text and "100.0% done" in text
    listed = invoke(env, "jobs")[1]
    assert any(line.startswith(job) and line.endswith(" named") and " 9/9" in line for line in listed.splitlines())
    assert invoke(env, "cancel", job)[1].strip() == f"{job} is already completed: nothing was cancelled"


def test_a_job_on_the_queue_of_its_model_before_keys_still_runs(
    tmp_path: Path,
    env: dict[str, str],  # noqa: F811
    tiny_model_dir: Path,
) -> None:
    write_mixed(tmp_path / "in.jsonl", 6)
    old = legacy_queue_name(str(tiny_model_dir))  # what an older submit named the queue: omlx:<model>
    code, out, err = invoke(env, "submit", str(tmp_path / "in.jsonl"), "--model", str(tiny_model_dir), "--queue", old)
    assert code == 0 and f"on {old}" in err
    proc = burst_worker(env, tiny_model_dir)  # no --queue: its keyed queue, and the old one
    assert proc.returncode == 0, proc.stderr
    assert json.loads(invoke(env, "status", out.strip(), "--json")[1])["status"] == "completed"


def test_run_takes_a_model_name(tmp_path: Path, env: dict[str, str], tiny_model_dir: Path) -> None:  # noqa: F811
    write_mixed(tmp_path / "in.jsonl", 4)
    code, _, err = invoke(
        env, "run", str(tmp_path / "in.jsonl"), "--model", str(tiny_model_dir), "--model-name", "local",
        "-o", str(tmp_path / "out.jsonl"),
    )  # fmt: skip
    assert code == 0, err
    job = next(line.split()[1] for line in err.splitlines() if line.startswith("job "))
    status = json.loads(invoke(env, "status", job, "--json")[1])
    assert status["model_name"] == "local" and status["live"]["generated_tokens"] > 0
    assert "model      local" in err  # run's closing status
