"""`results -o` and the CLI's clean errors (issue 10, defects 6 and 8), on real files, FIFOs, devices and
processes: write through devices, FIFOs and `-`; never replace a symlink's target silently; never the same
file twice; one-line errors; read-only commands create no database; an interrupted submit leaves no job."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from omlx_jobs.cli import cli
from omlx_jobs.store import open_store


def invoke(env: dict[str, str], *args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, list(args), env=env, catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


def cli_process(env: dict[str, str], *args: str, **kw: object) -> subprocess.CompletedProcess[str]:
    kw.setdefault("stdout", subprocess.PIPE)
    return subprocess.run(
        [sys.executable, "-m", "omlx_jobs.cli", *args], env=env, stderr=subprocess.PIPE, text=True, timeout=60, **kw
    )  # type: ignore[call-overload]


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("OMLX_JOBS_")}
    e.update({"OMLX_JOBS_DB": str(tmp_path / "jobs.db"), "OMLX_JOBS_HOME": str(tmp_path / "home")})
    e["OMLX_JOBS_REDIS_URL"] = "redis://127.0.0.1:1/0"  # nothing here needs Redis
    return e


@pytest.fixture
def job(tmp_path: Path, env: dict[str, str]) -> str:
    """A finished job with 3 completed requests and 1 failed one, straight in the store."""
    from omlx_jobs.jobs.submit import load_job

    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"custom_id": f"r{i}", "prompt": f"p{i}"}) + "\n" for i in range(4)))
    store = open_store(db_path=tmp_path / "jobs.db")
    loaded = load_job(store, src, "m")
    for i, req in enumerate(sorted(store.pending_requests(loaded.job_id), key=lambda r: r.idx)):
        if i == 3:
            store.record_failure(req.id, "engine_error", "boom")
            continue
        store.record_completion(
            req.id,
            output_text=f"out {i}\x00",
            finish_reason="stop",
            prompt_tokens=1,
            cached_tokens=0,
            completion_tokens=1,
        )
    store.close()
    return loaded.job_id


def test_dash_writes_to_stdout_and_no_file_named_dash(tmp_path: Path, env: dict[str, str], job: str) -> None:
    proc = cli_process(env, "results", job, "-o", "-", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(x) for x in proc.stdout.splitlines()]
    assert [x["custom_id"] for x in lines] == ["r0", "r1", "r2", "r3"]
    assert lines[0]["response"]["body"]["choices"][0]["text"] == "out 0\x00"  # the NUL survives export
    assert not (tmp_path / "-").exists()


def test_a_fifo_is_written_through(tmp_path: Path, env: dict[str, str], job: str) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()))
    reader.start()
    code, _, err = invoke(env, "results", job, "-o", str(fifo))  # no --force needed: nothing is replaced
    reader.join(10)
    assert code == 0, err
    assert len(got[0].splitlines()) == 4
    assert fifo.is_fifo()


def test_dev_full_reports_the_error_and_stays_a_device(env: dict[str, str], job: str) -> None:
    for extra in ([], ["--force"]):
        proc = cli_process(env, "results", job, "-o", "/dev/full", *extra)
        assert proc.returncode == 1
        assert proc.stderr.strip() == "error: cannot write /dev/full: No space left on device", proc.stderr
        assert Path("/dev/full").is_char_device()


def test_stdout_on_a_full_device_is_one_clean_line(env: dict[str, str], job: str) -> None:
    with open("/dev/full", "w") as full:
        proc = cli_process(env, "results", job, stdout=full)  # as `results JOB > /dev/full`
    assert proc.returncode == 1
    assert proc.stderr.strip() == "error: cannot write stdout: No space left on device", proc.stderr


def test_a_symlink_is_never_replaced_silently(tmp_path: Path, env: dict[str, str], job: str) -> None:
    target = tmp_path / "real.jsonl"
    target.write_text("keep me\n")
    link = tmp_path / "link.jsonl"
    link.symlink_to(target)
    code, _, err = invoke(env, "results", job, "-o", str(link))
    assert code == 1 and "symbolic link" in err and "--force" in err
    assert target.read_text() == "keep me\n"
    code, _, err = invoke(env, "results", job, "-o", str(link), "--force")  # written through, link kept
    assert code == 0, err
    assert link.is_symlink() and len(target.read_text().splitlines()) == 4
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere.jsonl")
    code, _, err = invoke(env, "results", job, "-o", str(dangling))
    assert code == 1 and "symbolic link" in err and not (tmp_path / "nowhere.jsonl").exists()


def test_output_and_errors_may_not_be_the_same_file(tmp_path: Path, env: dict[str, str], job: str) -> None:
    out = tmp_path / "x.jsonl"
    code, _, err = invoke(env, "results", job, "-o", str(out), "--errors", str(out))
    assert code == 1 and "same file" in err and not out.exists()
    (tmp_path / "sub").mkdir()
    code, _, err = invoke(env, "results", job, "-o", str(out), "--errors", str(tmp_path / "sub" / ".." / "x.jsonl"))
    assert code == 1 and "same file" in err
    hard = tmp_path / "hard.jsonl"
    out.write_text("")
    os.link(out, hard)
    code, _, err = invoke(env, "results", job, "-o", str(out), "--errors", str(hard), "--force")
    assert code == 1 and "same file" in err
    code, _, err = invoke(env, "results", job, "-o", str(tmp_path / "a"), "--errors", str(tmp_path / "b"))
    assert code == 0, err
    assert len((tmp_path / "a").read_text().splitlines()) == 3 and len((tmp_path / "b").read_text().splitlines()) == 1


def test_an_existing_file_needs_force(tmp_path: Path, env: dict[str, str], job: str) -> None:
    out = tmp_path / "out.jsonl"
    out.write_text("old\n")
    code, _, err = invoke(env, "results", job, "-o", str(out))
    assert code == 1 and "--force" in err and out.read_text() == "old\n"
    assert invoke(env, "results", job, "-o", str(out), "--force")[0] == 0
    assert len(out.read_text().splitlines()) == 4


def test_a_parent_that_is_a_file_is_one_line(tmp_path: Path, env: dict[str, str], job: str) -> None:
    (tmp_path / "afile").write_text("x")
    proc = cli_process(env, "results", job, "-o", str(tmp_path / "afile" / "out.jsonl"))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == f"error: cannot write the output to {tmp_path / 'afile' / 'out.jsonl'}: " + (
        f"{tmp_path / 'afile'} is a file, not a folder"
    )


@pytest.mark.parametrize(
    "args",
    [
        ("cancel", "batch_nope"),
        ("status", "batch_nope"),
        ("results", "batch_nope"),
        ("retry", "batch_nope"),
        ("resume", "batch_nope"),
    ],
)
def test_unknown_ids_and_missing_databases_are_one_line(
    tmp_path: Path, env: dict[str, str], args: tuple[str, ...]
) -> None:
    code, _, err = invoke(env, *args)  # no database exists yet; a traceback would raise here
    assert code == 1 and len(err.strip().splitlines()) == 1 and "no database" in err, err
    open_store(db_path=tmp_path / "jobs.db").close()
    code, _, err = invoke(env, *args)  # a database without that job
    assert code == 1 and err.strip().startswith("error: no job 'batch_nope'"), err


def test_read_only_commands_create_no_database(tmp_path: Path, env: dict[str, str]) -> None:
    home = tmp_path / "nothing-here"
    env = {**env, "OMLX_JOBS_DB": str(home / "sub" / "jobs.db")}
    for args in (("status", "batch_x"), ("results", "batch_x"), ("jobs",), ("workers",), ("cancel", "batch_x")):
        invoke(env, *args)
    assert not home.exists()
    code, out, _ = invoke(env, "jobs")
    assert code == 0 and "no jobs yet" in out


def _opening(pid: int) -> bool:
    """Whether process `pid` waits in open() on a FIFO (Linux: it sleeps in wait_for_partner)."""
    try:
        return Path(f"/proc/{pid}/wchan").read_text() in ("wait_for_partner", "fifo_open")
    except OSError:
        return False


def _submit_process(env: dict[str, str], src: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "omlx_jobs.cli", "submit", str(src), "--model", "m"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_submit_leaves_no_job(
    tmp_path: Path, env: dict[str, str], redis_url: str, sig: signal.Signals
) -> None:
    env = {**env, "OMLX_JOBS_REDIS_URL": redis_url}
    fifo = tmp_path / "lines"
    os.mkfifo(fifo)
    proc = _submit_process(env, fifo)
    with open(fifo, "w") as writer:  # submit reads 2,500 lines (one chunk stored), then waits for more
        for i in range(2500):
            writer.write(json.dumps({"prompt": f"p{i}"}) + "\n")
        writer.flush()
        store = open_store(db_path=tmp_path / "jobs.db")
        deadline = time.monotonic() + 30
        while not (store.list_jobs() and store.counts(store.list_jobs()[0].id).total >= 2000):
            assert time.monotonic() < deadline, "submit did not store the first chunk"
            time.sleep(0.05)
        assert store.list_jobs()[0].status == "validating"
        proc.send_signal(sig)  # while it blocks reading the FIFO
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "interrupted" in err
    assert store.list_jobs() == []  # rolled back: no job left in 'validating'
    with store.engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT count(*) FROM requests").scalar() == 0


def test_a_submit_interrupted_before_the_fifo_opens_leaves_no_job(
    tmp_path: Path, env: dict[str, str], redis_url: str
) -> None:
    env = {**env, "OMLX_JOBS_REDIS_URL": redis_url}
    fifo = tmp_path / "lines"
    os.mkfifo(fifo)
    proc = _submit_process(env, fifo)  # blocks opening the FIFO: no writer yet
    deadline = time.monotonic() + 60
    while not _opening(proc.pid):  # wait until it is inside open(), past imports and the store
        assert time.monotonic() < deadline and proc.poll() is None, "submit never got to open the FIFO"
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and "Traceback" not in err, err
    store = open_store(db_path=tmp_path / "jobs.db")
    assert store.list_jobs() == []
