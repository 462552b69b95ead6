"""What the page would otherwise read on every refresh from a whole job: its request counts, outcomes and token
histograms are each one index range of the job, but of all its rows, so a job of a million requests costs
seconds for each on SQLite. They are kept here between refreshes:

- a running job's for `COST_FACTOR` times as long as the last read took (at most MAX_SECONDS): a small job is
  read fresh on every refresh, a large one every few seconds;
- an ended job's until its status changes (a retry);
- what never changes (the requests' max_tokens sample) for as long as the entry stays.

A stale entry whose read took longer than SYNC_SECONDS is served while a background thread reads the new value
(one read per key at a time), so no refresh waits for a slow whole-job read once there is a value; cheaper
ones are read again at once. A first read waits, or returns None after `wait` seconds (the page then shows
that widget on a later refresh). Bounded (least recently used first out); one per
server process, shared by every page that is open.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

COST_FACTOR = 20.0
MAX_SECONDS = 60.0
MAX_ENTRIES = 512
SYNC_SECONDS = 0.05
FOREVER = float("inf")


class PageCache:
    def __init__(self, clock: Callable[[], float] = time.monotonic, max_entries: int = MAX_ENTRIES) -> None:
        self.clock, self.max_entries = clock, max_entries
        self._entries: OrderedDict[Hashable, tuple[Hashable, float, Any, float]] = OrderedDict()
        """key -> (version, fresh until, value, seconds its read took)"""
        self._reading: dict[Hashable, Future[Any]] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="page-cache")
        self.reads = 0
        """Reads that went to the store (the bench counts them)."""

    def get(
        self,
        key: Hashable,
        version: Hashable,
        read: Callable[[], T],
        *,
        ended: bool = False,
        wait: float | None = None,
    ) -> T | None:
        """`read()`'s value for `key` (see the module docstring). A value of another `version` (the job's status
        changed) is stale. `wait`: with nothing kept, how long to wait for the first read (None: until it ends);
        past it, None now and the value on a later call."""
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None:
                self._entries.move_to_end(key)
                if hit[0] == version and self.clock() < hit[1]:
                    return hit[2]  # type: ignore[no-any-return]
            future = self._start(key, version, read, ended)
        if hit is not None and hit[3] > SYNC_SECONDS:
            return hit[2]  # type: ignore[no-any-return]  # stale: the new value comes with a later call
        try:
            return future.result(timeout=wait)  # type: ignore[no-any-return]
        except TimeoutError:
            return None

    def _start(self, key: Hashable, version: Hashable, read: Callable[[], T], ended: bool) -> Future[Any]:
        """The read of `key` under way, or a new one (the caller holds the lock)."""
        future = self._reading.get(key)
        if future is None:
            future = self._reading[key] = self._pool.submit(self._read, key, version, read, ended)
        return future

    def _read(self, key: Hashable, version: Hashable, read: Callable[[], T], ended: bool) -> T:
        started = self.clock()
        try:
            value = read()
        except BaseException as exc:
            with self._lock:
                self._reading.pop(key, None)
            log.warning("page: reading %s failed: %s", key, exc)
            raise
        self.reads += 1
        with self._lock:
            self._reading.pop(key, None)
        self.put(key, version, value, took=self.clock() - started, ended=ended)
        return value

    def peek(self, key: Hashable, version: Hashable) -> tuple[bool, Any]:
        """(True, the value) for a fresh entry of `version`, else (False, None)."""
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None and hit[0] == version and self.clock() < hit[1]:
                self._entries.move_to_end(key)
                return True, hit[2]
        return False, None

    def put(self, key: Hashable, version: Hashable, value: Any, *, took: float = 0.0, ended: bool = False) -> None:
        """Keep `value`, read in `took` seconds."""
        keep = FOREVER if ended else min(MAX_SECONDS, took * COST_FACTOR)
        with self._lock:
            self._entries[key] = (version, self.clock() + keep, value, took)
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
