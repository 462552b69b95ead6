"""Waiting out a database restart: backoff until the store answers again, then the shard runs again.

A worker whose store went away (StoreUnavailable) waits as it does for Redis. Nothing finished is lost meanwhile:
each result was committed before it counted, and a shard run again skips requests that have one. Only a store that
refuses work for good (a full disk, a read-only database: a plain StoreError) stops the worker.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from omlx_jobs.store import Store, StoreUnavailable

log = logging.getLogger(__name__)

FIRST_WAIT = 0.5
MAX_WAIT = 30.0
RERUNS = 20
"""Times one shard message is run again after its store went away, before it goes back to RQ's retries."""


def await_store(
    store: Store,
    stopping: Callable[[], bool],
    *,
    first: float = FIRST_WAIT,
    most: float = MAX_WAIT,
    sleep: Callable[[float], None] = time.sleep,
) -> bool:
    """Ping `store` with backoff (first, doubling up to `most` seconds) until it answers: True; or False as soon as
    `stopping()` says the worker is stopping (a stop signal while the database is down is a clean stop)."""
    delay = first
    while not stopping():
        try:
            store.ping()
            return True
        except StoreUnavailable as exc:
            log.warning("the database is unreachable (%s); trying again in %.1fs", exc, delay)
        sleep(delay)
        delay = min(delay * 2, most)
    return False
