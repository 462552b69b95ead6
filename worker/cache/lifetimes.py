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
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from omlx_jobs.errors import OmlxError


class Pinnable(Protocol):
    """What lifetimes reads and writes of a cache entry (prefix_cache.Entry): its key, its pins, and the last
    admission position that needs it."""

    key: bytes
    pins: int
    needed_until: int

    @property
    def tokens(self) -> int: ...


E = TypeVar("E", bound=Pinnable)


class LifetimeError(OmlxError, RuntimeError):
    """A cache entry released twice, or a hold left over: a bug in the engine, never the user's input."""


@dataclass(eq=False)
class Hold(Generic[E]):
    """One pin on one entry: until admission passes `until`, or (until None) until released."""

    entry: E
    until: int | None
    released: bool = False


class Lifetimes(Generic[E]):
    """Holds on cache entries, and the admission position the run has reached."""

    def __init__(self) -> None:
        self.position = 0
        self._holds: list[Hold[E]] = []  # every hold not yet released
        self._ending: list[tuple[int, int, Hold[E]]] = []  # (until, seq, hold): a heap, the first to end on top
        self._seq = itertools.count()

    def __len__(self) -> int:
        """Holds outstanding."""
        return len(self._holds)

    def start_run(self, entries: Iterable[E]) -> None:
        """A new run: entries left from earlier runs are needed by nobody yet (their subtrees here are unknown)."""
        if self._holds:
            raise LifetimeError(f"{len(self._holds)} cache entries are still held from an earlier run")
        self._ending = []
        for entry in entries:
            entry.needed_until = -1
        self.position = 0

    def need(self, entry: E, until: int) -> None:
        """`entry` is reused up to position `until` (inclusive)."""
        entry.needed_until = max(entry.needed_until, until)

    def hold(self, entry: E, until: int | None) -> Hold[E]:
        """Pin `entry` until admission passes position `until`, or, with None, until `release` (say, for as long
        as a row reads the entry in place)."""
        hold = Hold(entry, until)
        if until is not None:
            self.need(entry, until)
            heapq.heappush(self._ending, (until, next(self._seq), hold))
        entry.pins += 1
        self._holds.append(hold)
        return hold

    def release(self, hold: Hold[E]) -> None:
        """Drop a hold now; releasing one twice raises."""
        if hold.released:
            raise LifetimeError(f"a hold on a cache entry of {hold.entry.tokens} tokens was released twice")
        hold.released = True
        self._holds.remove(hold)
        self._unpin(hold.entry)

    def release_entry(self, entry: E) -> None:
        """Drop the hold on `entry` that would end first; raises if it has none."""
        mine = [h for h in self._holds if h.entry is entry]
        if not mine:
            raise LifetimeError(f"released a cache entry of {entry.tokens} tokens that is not held")
        self.release(min(mine, key=lambda h: h.until if h.until is not None else sys.maxsize))

    def advance(self, position: int) -> list[E]:
        """Admission has reached `position`: drop the holds that end before it; returns their entries."""
        if position < self.position:
            raise LifetimeError(f"admission went back from position {self.position} to {position}")
        self.position = position
        released = []
        while self._ending and self._ending[0][0] < position:
            _, _, hold = heapq.heappop(self._ending)
            if not hold.released:  # released early by hand: already unpinned
                self.release(hold)
                released.append(hold.entry)
        return released

    def release_all(self) -> list[E]:
        """The run ended (or failed): drop every hold."""
        released = [h.entry for h in self._holds]
        for hold in list(self._holds):
            self.release(hold)
        self._ending = []
        return released

    def finished(self, entry: E) -> bool:
        """True once admission is past the last position that needs `entry`."""
        return entry.needed_until < self.position

    @staticmethod
    def _unpin(entry: Pinnable) -> None:
        if entry.pins <= 0:
            raise LifetimeError(f"a cache entry of {entry.tokens} tokens has {entry.pins} pins and was released")
        entry.pins -= 1
