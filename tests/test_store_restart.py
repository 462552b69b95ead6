"""A PostgreSQL restart does not stop a worker (issue 21, finding 4): the worker waits until the database answers
again and runs its shard again; only a full disk or a read-only database stops it.

The restart is real from the worker's side: its store reaches PostgreSQL through a TCP relay that the test takes
down (every connection cut, new ones refused) and brings back 1.5 s later, mid-shard, the way a restart looks
to a client. (The test database's server is shared, so the relay stands in for restarting it.)"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError

from omlx_jobs.jobs import lifecycle
from omlx_jobs.jobs.submit import load_job
from omlx_jobs.store import RequestStatus, Store, StoreError, StoreUnavailable
from omlx_jobs.store.errors import friendly
from omlx_jobs.worker import entry
from omlx_jobs.worker.engine.config import EngineConfig
from omlx_jobs.worker.engine.loop import Engine
from omlx_jobs.worker.runtime import reconnect
from omlx_jobs.worker.runtime.context import WorkerContext, install

PG = "postgresql+psycopg://u@db:5432/x"


def _error(text: str) -> OperationalError:
    return OperationalError("SELECT 1", {}, Exception(text))


@pytest.mark.parametrize(
    "text",
    [
        "server closed the connection unexpectedly",
        "terminating connection due to administrator command",
        'connection to server at "127.0.0.1", port 5432 failed: Connection refused',
        "FATAL:  the database system is shutting down",
        "FATAL:  the database system is starting up",
        "consuming input failed: EOF detected",
    ],
)
def test_a_lost_connection_is_unavailable_not_fatal(text: str) -> None:
    err = friendly(_error(text), PG)
    assert isinstance(err, StoreUnavailable) and "unreachable for now" in str(err)


@pytest.mark.parametrize(
    "text",
    [
        "could not extend file: No space left on device",
        "cannot execute INSERT in a read-only transaction",
        'relation "requests" does not exist',
    ],
)
def test_a_full_disk_or_a_read_only_database_stays_fatal(text: str) -> None:
    err = friendly(_error(text), PG)
    assert isinstance(err, StoreError) and not isinstance(err, StoreUnavailable)


def test_await_store_backs_off_until_it_answers() -> None:
    class Flaky:
        calls = 0

        def ping(self) -> None:
            self.calls += 1
            if self.calls < 4:
                raise StoreUnavailable("down")

    slept: list[float] = []
    assert reconnect.await_store(Flaky(), lambda: False, first=0.5, most=1.5, sleep=slept.append)  # type: ignore[arg-type]
    assert slept == [0.5, 1.0, 1.5]
    assert not reconnect.await_store(Flaky(), lambda: True, sleep=slept.append)  # type: ignore[arg-type]


class Relay:
    """A TCP relay to PostgreSQL that can go down (all connections cut, the port refusing) and come back."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        self.port = probe.getsockname()[1]
        probe.close()
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self.up()

    def up(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(16)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def down(self) -> None:
        assert self._listener is not None
        with contextlib.suppress(OSError):  # shutdown wakes the accept() (a close alone would not)
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self._listener = None
        with self._lock:
            for c in self._conns:
                with contextlib.suppress(OSError):
                    c.shutdown(socket.SHUT_RDWR)
                c.close()
            self._conns.clear()

    def restart(self, downtime: float) -> None:
        self.down()
        threading.Timer(downtime, self.up).start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            with self._lock:
                self._conns += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                with contextlib.suppress(OSError):
                    s.close()


def test_a_worker_waits_out_a_postgresql_restart(pg_url: str, tmp_path: Path, tiny_loaded: Any) -> None:
    url = make_url(pg_url)
    relay = Relay(url.host or "127.0.0.1", url.port or 5432)
    store = Store(url.set(host="127.0.0.1", port=relay.port).render_as_string(hide_password=False))
    src = tmp_path / "in.jsonl"
    src.write_text(
        "".join(
            json.dumps({"custom_id": f"r{i}", "prompt": f"Count to {i} please", "max_tokens": 6, "temperature": 0})
            + "\n"
            for i in range(12)
        )
    )
    job = load_job(store, src, "m").job_id
    (one,) = store.shards(job)
    engine = Engine(tiny_loaded, EngineConfig(completion_batch_size=2, prefill_batch_size=2))
    ctx = WorkerContext(store=store, engine=engine)
    restarted: list[float] = []

    def meter(requests: int, tokens: int) -> None:  # after the first results: the database restarts
        if not restarted:
            restarted.append(time.monotonic())
            relay.restart(1.5)

    ctx.meter = meter  # type: ignore[method-assign]
    install(ctx)
    try:
        outcome = entry.run_shard(job, one.first_pos, one.end_pos)
    finally:
        install(None)
    assert restarted and ctx.fatal is None  # the worker carried on
    rows = list(store.iter_requests(job))
    assert [r.status for r in rows] == [RequestStatus.COMPLETED] * 12
    assert store.get_job(job).status == lifecycle.COMPLETED
    assert outcome["completed"] + 2 <= 12  # the run after the restart did the rest, not all
    relay.down()
    store.close()
