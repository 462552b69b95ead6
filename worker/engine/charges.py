"""Whose prompt tokens a warm-up computed: the first sequence that reuses them (issue 10, defect 9). Pure: no MLX.

A request's cached_tokens counts only the prompt tokens not computed for it. A warm-up computes a shared prefix
before its group is admitted; the first sequence admitted on it is charged those tokens (they were computed for
it), and every later one, including the other n - 1 choices of the same request, reuses them as cached. So the
requests' computed tokens (prompt - cached) add up to the job's prefill tokens when every warm-up is used.
"""

from __future__ import annotations

from dataclasses import dataclass

from omlx_jobs.worker.prompts import common_prefix


@dataclass
class _Computed:
    key: bytes
    start: int
    """Positions [start, end) of prefix `key` were computed and not yet charged to any sequence."""
    end: int


class Charges:
    """Warm-up tokens computed in a run and not yet charged to a sequence."""

    def __init__(self) -> None:
        self._open: list[_Computed] = []

    def __len__(self) -> int:
        return len(self._open)

    def computed(self, key: bytes, start: int, end: int) -> None:
        """A warm-up computed positions [start, end) of the prefix `key`."""
        if end > start:
            self._open.append(_Computed(key, start, end))

    def cached(self, key: bytes, reused: int) -> int:
        """The cached tokens of a sequence of prompt `key` that starts from `reused` cached positions: those less
        the computed positions no sequence was charged yet, which are charged to this one.

        Only positions of the cache the sequence starts from are its own: a warm-up whose key leaves the
        sequence's key before both the warm-up's end and the reuse's end is another copy (two warm-ups that
        computed a shared root each, issue 21, 12). The sequence starts from one copy of each position, so the
        deepest warm-up is charged first and any other that overlaps positions already charged is skipped."""
        if not self._open or reused <= 0:
            return reused
        mine = []
        for c in self._open:
            hi = min(c.end, reused)
            if hi > c.start and common_prefix(c.key, key) >= hi:
                mine.append((hi, c))
        charged: list[tuple[int, int]] = []
        for hi, c in sorted(mine, key=lambda m: -m[0]):
            if any(c.start < b and a < hi for a, b in charged):
                continue
            charged.append((c.start, hi))
            c.start = hi
            if c.start >= c.end:
                self._open.remove(c)
        return reused - sum(b - a for a, b in charged)
