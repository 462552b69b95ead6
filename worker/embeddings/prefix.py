"""Which inputs share a leading run of tokens that a causal model may compute once (prefix reuse). Pure: no MLX.

Sorted by their tokens, inputs that share a start lie next to each other; a greedy pass adds the next input to
the open group while the group's common prefix stays at least `min_tokens` long. Every member keeps at least one
token of its own after the prefix, so its last position is computed in its own row. Inputs that share no such
prefix with a neighbour form the group of prefix 0: they run whole, as without reuse.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PrefixGroup:
    """Inputs (indices) whose first `prefix` tokens are the same; prefix 0: no reuse."""

    prefix: int
    members: list[int]


def _common(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    n = 0
    for x, y in zip(a[:limit], b[:limit], strict=False):
        if x != y:
            break
        n += 1
    return n


def prefix_groups(rows: Sequence[Sequence[int]], min_tokens: int) -> list[PrefixGroup]:
    """The groups of `rows` that share at least `min_tokens` leading tokens (each of two or more members), then
    one group of prefix 0 with every other row (if any)."""
    order = sorted(range(len(rows)), key=lambda i: tuple(rows[i]))
    groups: list[PrefixGroup] = []
    loose: list[int] = []
    current: list[int] = []
    shared = 0

    def close() -> None:
        if len(current) > 1:
            groups.append(PrefixGroup(shared, list(current)))
        else:
            loose.extend(current)

    for i in order:
        if current:
            n = _common(rows[current[0]], rows[i], min(shared, len(rows[i]) - 1))
            if n >= max(min_tokens, 1):
                current.append(i)
                shared = n
                continue
            close()
        current, shared = [i], len(rows[i]) - 1
    close()
    if loose:
        groups.append(PrefixGroup(0, sorted(loose)))
    return groups


def computed_tokens(rows: Sequence[Sequence[int]], groups: Sequence[PrefixGroup]) -> int:
    """Positions the groups compute: each shared prefix once, then every member's own suffix."""
    return sum(g.prefix + sum(len(rows[i]) - g.prefix for i in g.members) for g in groups)
