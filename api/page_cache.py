"""What the page would otherwise read on every refresh from a whole job: its request counts, outcomes and token
histograms are each one index range of the job, but of all its rows, so a job of a million requests costs
about a second for each. They are kept here between refreshes:

- a running job's for `COST_FACTOR` times as long as the last read took (between MIN_SECONDS and MAX_SECONDS):
  a small job is read fresh on every refresh, a large one every few seconds;
- an ended job's until its status changes (a retry);
- what never changes (the requests' max_tokens sample) for as long as the entry stays.

Bounded (least recently used first out); one per server process, shared by every page that is open.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

T = TypeVar("T")

COST_FACTOR = 20.0
MIN_SECONDS = 0.0
MAX_SECONDS = 30.0
MAX_ENTRIES = 512
FOREVER = float("inf")


class PageCache:
    def __init__(self, clock: Callable[[], float] = time.monotonic, max_entries: int = MAX_ENTRIES) -> None:
        self.clock, self.max_entries = clock, max_entries
        self._entries: OrderedDict[Hashable, tuple[Hashable, float, Any]] = OrderedDict()
        self._lock = threading.Lock()
        self.reads = 0
        """Reads that went to the store (the bench counts them)."""

    def get(self, key: Hashable, version: Hashable, read: Callable[[], T], *, ended: bool = False) -> T:
        """`read()`'s value for `key`, kept while `version` is the same and the entry is fresh (see above);
        `ended`: the job has ended, so the value holds until `version` changes."""
        found, value = self.peek(key, version)
        if found:
            return value  # type: ignore[no-any-return]
        started = self.clock()
        value = read()
        self.reads += 1
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
        """Keep `value`, read in `took` seconds (see the module docstring for how long)."""
        keep = FOREVER if ended else min(MAX_SECONDS, max(MIN_SECONDS, took * COST_FACTOR))
        with self._lock:
            self._entries[key] = (version, self.clock() + keep, value)
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
