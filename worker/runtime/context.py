"""The worker process's context: its store and engine, where it hands work back, and its stop flags.

`omlx-jobs worker` builds one and installs it; RQ then calls worker/entry.py's `run_shard`, which runs each shard
in it (the model stays loaded between shards).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from redis import Redis

from omlx_jobs import defaults
from omlx_jobs.jobs.images import ImageAccess
from omlx_jobs.store import Store
from omlx_jobs.worker.engine.contract import Control, EngineLike
from omlx_jobs.worker.runtime.reconnects import RedisState

DEFAULT_DRAIN_TIMEOUT = defaults.DRAIN_TIMEOUT


@dataclass
class WorkerContext:
    store: Store
    engine: EngineLike
    redis: Redis | None = None
    queue: str | None = None
    drain_timeout: float = DEFAULT_DRAIN_TIMEOUT
    images: ImageAccess = field(default_factory=ImageAccess)
    """Where images in messages may come from on this worker (--allow-files-from, --allow-remote-images); the
    worker checks every image again against it, whatever submit allowed."""
    fatal: str | None = None
    """Set when the store fails (disk full, read-only): the worker stops taking work."""
    name: str | None = None
    """The RQ worker's name: recorded with every shard run (status --json lists who ran a job)."""
    model_name: str | None = None
    """The model's short name for `omlx-jobs workers` and the page (--model-name; default: derived)."""
    current: tuple[str, int, int] | None = None
    """The shard running now (job id, first, end position): `omlx-jobs workers` shows it."""
    last_shard: tuple[str, int] | None = None
    on_shard: Callable[[], None] | None = field(default=None, repr=False)
    """Called when a shard starts (the RQ worker publishes its record then)."""
    """The shard finished last (job id, first position): its prefix group is in this worker's cache."""
    requests_done: int = 0
    shards_done: int = 0
    requests_ended: int = 0
    """Requests the shards run here completed or failed (a failure before the engine included)."""
    handed_back: int = 0
    """Requests of stopped shards handed back to the queue (a drain, a stop): said when the worker exits."""
    redis_state: RedisState = field(default_factory=RedisState, repr=False)
    """Whether Redis is down: reconnect noise is logged once per outage (runtime/reconnects.py)."""
    _drain_deadline: float | None = field(default=None, repr=False)
    _stop: bool = field(default=False, repr=False)

    def request_drain(self) -> None:
        """Stop admitting; in-flight requests get drain_timeout seconds to finish, the rest go back to the queue."""
        if self._drain_deadline is None:
            self._drain_deadline = time.monotonic() + self.drain_timeout

    def request_stop(self) -> None:
        """Stop now: unfinished requests stay pending and go back to the queue."""
        self._stop = True

    @property
    def stopping(self) -> bool:
        return self._stop or self._drain_deadline is not None

    def meter(self, requests: int, tokens: int) -> None:
        """Count committed results (tokens per second come from the engine's live counters, jobs/live.py)."""
        self.requests_done += requests

    def control(self) -> Control:
        """What the engine should do between steps (run, drain, stop)."""
        if self._stop:
            return Control.STOP
        if self._drain_deadline is not None:
            return Control.DRAIN if time.monotonic() < self._drain_deadline else Control.STOP
        return Control.RUN


_context: WorkerContext | None = None


def install(context: WorkerContext | None) -> None:
    """Make `context` the one run_shard runs in (None: none)."""
    global _context
    _context = context


def current() -> WorkerContext:
    """The installed context; RuntimeError outside `omlx-jobs worker`."""
    if _context is None:
        raise RuntimeError("run_shard runs inside `omlx-jobs worker`, which loads the model first")
    return _context
