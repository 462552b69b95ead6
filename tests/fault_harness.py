"""Real parts for the fault tests and the soak script: private redis-server processes, worker processes on
one SQLite store, and greedy request files whose results do not depend on batching."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from click.testing import CliRunner

from omlx_jobs.cli import cli
from omlx_jobs.store import open_store

SYSTEM = "You are a helpful assistant. Answer briefly and clearly."


def write_greedy(path: Path, n: int, max_tokens: int = 8) -> Path:
    """n greedy requests: chat lines sharing a system prompt, and completions. Results do not depend on batching."""
    with path.open("w") as f:
        for i in range(n):
            if i % 2:
                line: dict[str, Any] = {"prompt": f"Once upon a time {i} there was"}
            else:
                line = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"q {i}"}]}
            f.write(json.dumps({"custom_id": f"req-{i}", **line, "max_tokens": max_tokens, "temperature": 0}) + "\n")
    return path


def invoke(env: dict[str, str], *args: str) -> tuple[int, str, str]:
    """Run the CLI in this process; returns (exit code, stdout, stderr)."""
    result = CliRunner().invoke(cli, list(args), env=env, catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


def outputs(db: Path, job_id: str | None = None) -> dict[str, str | None]:
    """custom_id -> output text of a job (the only job in `db` if no id is given)."""
    store = open_store(db_path=db)
    try:
        job_id = job_id or store.list_jobs()[0].id
        return {r.custom_id: r.output_text for r in store.iter_requests(job_id, columns=["custom_id", "output_text"])}
    finally:
        store.close()


_DEQUEUED = re.compile(r": omlx-jobs shard (\S+) \(")


def shards_taken(log: Path) -> list[str]:
    """RQ ids of the shards a worker took, from its -v log (RQ logs "<queue>: <description> (<id>)")."""
    return _DEQUEUED.findall(log.read_text(errors="replace"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """A private redis-server without persistence: a kill loses everything, like a restart of a cache Redis."""

    def __init__(self, workdir: Path, *args: str, port: int | None = None, tls: bool = False) -> None:
        self.workdir, self.args, self.tls = workdir, args, tls
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> RedisServer:
        port = ["--port", "0", "--tls-port", str(self.port)] if self.tls else ["--port", str(self.port)]
        cmd = ["redis-server", *port, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        log = (self.workdir / f"redis-{self.port}.log").open("ab")
        self.proc = subprocess.Popen([*cmd, "--dir", str(self.workdir), *self.args], stdout=log, stderr=log)
        deadline = time.monotonic() + 10
        while not self._listening():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"redis-server did not start: {Path(log.name).read_text()[-2000:]}")
            time.sleep(0.05)
        return self

    def _listening(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                return True
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL: the data set is gone."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def url(self, password: str | None = None, query: str = "") -> str:
        auth = f":{password}@" if password else ""
        return f"{'rediss' if self.tls else 'redis'}://{auth}127.0.0.1:{self.port}/0{query}"

    def __enter__(self) -> RedisServer:
        return self if self.proc is not None and self.proc.poll() is None else self.start()

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.kill()


class Cluster:
    """One SQLite store and one Redis URL; worker processes started, signalled and killed at will."""

    def __init__(self, workdir: Path, redis_url: str, model: Path, worker_args: Sequence[str] = ()) -> None:
        self.tmp, self.model, self.worker_args = workdir, model, tuple(worker_args)
        self.db = workdir / "jobs.db"
        self.env = {
            **os.environ,
            "OMLX_JOBS_DB": str(self.db),
            "OMLX_JOBS_REDIS_URL": redis_url,
            "OMLX_JOBS_HOME": str(workdir / "home"),
        }
        self.env.pop("OMLX_JOBS_DATABASE_URL", None)
        self.workers: list[subprocess.Popen[bytes]] = []
        self._store: Any = None

    @property
    def store(self) -> Any:
        if self._store is None:
            self._store = open_store(db_path=self.db)
        return self._store

    def close_store(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None

    def cli(self, *args: str) -> tuple[int, str, str]:
        return invoke(self.env, *args)

    def submit(self, src: Path, *extra: str) -> str:
        code, out, err = self.cli("submit", str(src), "--model", str(self.model), *extra)
        if code != 0:
            raise AssertionError(f"submit failed ({code}): {err}")
        return out.strip()

    def start_worker(self, *extra: str, burst: bool = True, **popen: Any) -> subprocess.Popen[bytes]:
        log = (self.tmp / f"worker-{len(self.workers)}.log").open("wb")
        cmd = [sys.executable, "-m", "omlx_jobs.cli", "-v", "worker", "--model", str(self.model), *self.worker_args]
        cmd += [*(["--burst"] if burst else []), *extra]
        proc = subprocess.Popen(cmd, env=self.env, stdout=log, stderr=log, **popen)
        self.workers.append(proc)
        return proc

    def logs(self, tail: int = 3000) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-tail:]}" for p in sorted(self.tmp.glob("worker-*.log")))

    def wait_worker(self, proc: subprocess.Popen[bytes], timeout: float = 120) -> int:
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"worker {proc.pid} still running after {timeout}s\n{self.logs()}") from None

    def wait_until(self, what: str, cond: Callable[[], bool], timeout: float = 60, poll: float = 0.02) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out waiting for {what}\n{self.logs()}")
            time.sleep(poll)

    def completed(self, job: str) -> int:
        return int(self.store.counts(job).completed)

    def rows(self, job: str) -> list[Any]:
        cols = ["custom_id", "status", "output_text", "attempts", "error_code", "finished_at"]
        return list(self.store.iter_requests(job, columns=cols))

    def close(self) -> None:
        for proc in self.workers:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        self.close_store()
