"""The n-gram (prompt-lookup) proposer: drafts a row's next tokens from an earlier occurrence of its last n tokens.

Pure: no MLX. One NgramProposer per row holds the row's history (prompt and generated tokens) and an index of
every `min_n`-gram's end positions, updated as tokens arrive. A proposal takes the candidate whose match with the
history's suffix is longest (up to `max_n` tokens, the most recent on ties) and drafts the tokens that followed it.
"""

from __future__ import annotations

from collections.abc import Iterable

MIN_N = 2
"""The shortest suffix a draft is taken from."""
MAX_N = 6
"""Matches are compared up to this many tokens (a longer match ranks first)."""
MAX_CANDIDATES = 8
"""Earlier occurrences of the last min_n tokens looked at per proposal, the most recent first."""


class NgramProposer:
    """One row's history and its n-gram index."""

    def __init__(
        self, tokens: Iterable[int] = (), *, min_n: int = MIN_N, max_n: int = MAX_N, candidates: int = MAX_CANDIDATES
    ) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError("need 1 <= min_n <= max_n")
        self.min_n, self.max_n, self.candidates = min_n, max_n, candidates
        self.history: list[int] = []
        self._ends: dict[tuple[int, ...], list[int]] = {}
        """Each min_n-gram -> the positions of its last token, ascending."""
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.history)

    def extend(self, tokens: Iterable[int]) -> None:
        h, n = self.history, self.min_n
        for t in tokens:
            h.append(t)
            if len(h) >= n:
                self._ends.setdefault(tuple(h[-n:]), []).append(len(h) - 1)

    def retract(self) -> None:
        """Take the last token back off (a pending token is added for one proposal only)."""
        h, n = self.history, self.min_n
        if len(h) >= n:
            ends = self._ends[tuple(h[-n:])]
            ends.pop()
            if not ends:
                del self._ends[tuple(h[-n:])]
        h.pop()

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the best earlier match of the history's suffix ([] if none)."""
        h, n = self.history, self.min_n
        last = len(h) - 1
        if k < 1 or last < n:
            return []
        ends = self._ends.get(tuple(h[-n:]))
        if not ends or len(ends) < 2:
            return []
        best, best_len = -1, 0
        for end in reversed(ends[-self.candidates - 1 :]):
            if end >= last:
                continue
            m = n
            while m < self.max_n and end - m >= 0 and h[end - m] == h[last - m]:
                m += 1
            if m > best_len:
                best, best_len = end, m
                if m == self.max_n:
                    break
        if best < 0:
            return []
        return h[best + 1 : min(best + 1 + k, last + 1)]
