"""One log line per change of Redis's state, not one per reconnect attempt.

While Redis is down, RQ's work loop and its pubsub thread log "could not connect to Redis instance" every second
or two, and our heartbeat and work loop add their own. A filter on those loggers lets the first such line of an
outage through and drops the rest; when the worker reaches Redis again it says so, once, with how long it was
down. The state is pure logic (RedisState), tested without Redis.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)

RECONNECT_MESSAGES = re.compile(
    r"could not connect to Redis|Redis unreachable|Redis error|heartbeat failed \(|could not publish the worker"
)
"""The messages (RQ's and ours) that repeat while Redis is down."""
NOISY_LOGGERS = ("rq.worker", "omlx_jobs.worker.runtime.rq_worker")


class RedisState:
    """Up or down, and whether a report is a change. Thread-safe: RQ's pubsub thread reports too."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.down_since: float | None = None
        self._lock = threading.Lock()

    def down(self) -> bool:
        """Redis failed: True for the first failure of an outage (that line is worth logging)."""
        with self._lock:
            if self.down_since is not None:
                return False
            self.down_since = self.clock()
            return True

    def up(self) -> float | None:
        """Redis answered: the seconds it was down if this ends an outage, else None."""
        with self._lock:
            if self.down_since is None:
                return None
            seconds, self.down_since = self.clock() - self.down_since, None
            return seconds


class ReconnectFilter(logging.Filter):
    """Drops reconnect noise after an outage's first line (RECONNECT_MESSAGES); lets everything else through."""

    def __init__(self, state: RedisState) -> None:
        super().__init__()
        self.state = state

    def filter(self, record: logging.LogRecord) -> bool:
        if not RECONNECT_MESSAGES.search(str(record.msg)):
            return True
        if self.state.down():
            record.msg = f"{record.msg} (further reconnect attempts are not logged until Redis is back)"
            return True
        return False


def reached(state: RedisState) -> None:
    """Redis answered: say it is back if it was down."""
    seconds = state.up()
    if seconds is not None:
        log.warning("Redis is reachable again after %.0fs", seconds)


@contextmanager
def quiet_reconnects(state: RedisState, loggers: tuple[str, ...] = NOISY_LOGGERS) -> Iterator[RedisState]:
    """Filter the noisy loggers while the worker serves."""
    noise = ReconnectFilter(state)
    targets = [logging.getLogger(name) for name in loggers]
    for logger in targets:
        logger.addFilter(noise)
    try:
        yield state
    finally:
        for logger in targets:
            logger.removeFilter(noise)
