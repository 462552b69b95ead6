"""Cache-entry lifetimes: which prefix-cache entries a run still needs, and which it holds right now. Pure: no MLX.

Positions count admissions in the run's order (see scheduler.py). An entry is *needed* until the last position
that reuses it (`Entry.needed_until`); past it, the entry's subtree is finished and it is the first to go when
memory is short. An entry is *held* (pinned) from the warm-up that makes it until its group has been admitted,
and a held entry is never evicted. Only this object writes `Entry.needed_until` and `Entry.pins`, and misuse
raises LifetimeError rather than being clamped: releasing what is not held, or starting a run while holds of the
last one are still out.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from omlx_jobs.errors import OmlxError

if TYPE_CHECKING:
    from omlx_jobs.worker.prefix_cache import Entry


class LifetimeError(OmlxError, RuntimeError):
    """A cache entry released twice, or a hold left over: a bug in the engine, never the user's input."""


@dataclass(order=True)
class _Hold:
    until: int
    seq: int
    entry: Entry = field(compare=False)


class Lifetimes:
    """Holds on cache entries, each until an admission position, and the position admission has reached."""

    def __init__(self) -> None:
        self.position = 0
        self._holds: list[_Hold] = []  # a heap: the hold that ends first on top
        self._seq = itertools.count()

    def __len__(self) -> int:
        """Holds outstanding."""
        return len(self._holds)

    def start_run(self, entries: Iterable[Entry]) -> None:
        """A new run: entries left from earlier runs are needed by nobody yet (their subtrees here are unknown)."""
        if self._holds:
            raise LifetimeError(f"{len(self._holds)} cache entries are still held from an earlier run")
        for entry in entries:
            entry.needed_until = -1
        self.position = 0

    def need(self, entry: Entry, until: int) -> None:
        """`entry` is reused up to position `until` (inclusive)."""
        entry.needed_until = max(entry.needed_until, until)

    def hold(self, entry: Entry, until: int) -> None:
        """Pin `entry` until admission passes position `until`."""
        self.need(entry, until)
        entry.pins += 1
        heapq.heappush(self._holds, _Hold(until, next(self._seq), entry))

    def release(self, entry: Entry) -> None:
        """Drop one hold on `entry` now (the one that would end first)."""
        mine = [h for h in self._holds if h.entry is entry]
        if not mine:
            raise LifetimeError(f"released a cache entry of {entry.tokens} tokens that is not held")
        self._holds.remove(min(mine))
        heapq.heapify(self._holds)
        self._unpin(entry)

    def advance(self, position: int) -> list[Entry]:
        """Admission has reached `position`: drop the holds that end before it; returns their entries."""
        if position < self.position:
            raise LifetimeError(f"admission went back from position {self.position} to {position}")
        self.position = position
        released = []
        while self._holds and self._holds[0].until < position:
            hold = heapq.heappop(self._holds)
            self._unpin(hold.entry)
            released.append(hold.entry)
        return released

    def release_all(self) -> list[Entry]:
        """The run ended (or failed): drop every hold."""
        released = [h.entry for h in self._holds]
        self._holds = []
        for entry in released:
            self._unpin(entry)
        return released

    def finished(self, entry: Entry) -> bool:
        """True once admission is past the last position that needs `entry`."""
        return entry.needed_until < self.position

    @staticmethod
    def _unpin(entry: Entry) -> None:
        if entry.pins <= 0:
            raise LifetimeError(f"a cache entry of {entry.tokens} tokens has {entry.pins} pins and was released")
        entry.pins -= 1
