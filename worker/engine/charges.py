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
        the computed positions no sequence was charged yet, which are charged to this one."""
        if not self._open or reused <= 0:
            return reused
        cached = reused
        for c in list(self._open):
            use = min(c.end, reused, common_prefix(c.key, key)) - c.start
            if use <= 0:
                continue
            cached -= use
            c.start += use
            if c.start >= c.end:
                self._open.remove(c)
        return max(cached, 0)
