"""Which inputs run together: sorted by length, cut into batches whose padded size stays under a token budget.
Pure: no MLX.

Sorting by length keeps padding small (each batch pads to its longest row); the budget bounds a batch's
activations (rows x longest row), and `max_rows` the rows of short inputs.
"""

from __future__ import annotations

from collections.abc import Sequence


def plan_batches(lengths: Sequence[int], token_budget: int, max_rows: int) -> list[list[int]]:
    """Indices into `lengths`, as batches: longest first, each padded size (rows x its longest) <= token_budget
    (a single input longer than the budget runs alone)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        longest = lengths[current[0]] if current else lengths[i]
        if current and ((len(current) + 1) * longest > token_budget or len(current) >= max_rows):
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def padded_tokens(lengths: Sequence[int], batches: Sequence[Sequence[int]]) -> int:
    """Positions computed for `batches`, padding included."""
    return sum(len(b) * max(lengths[i] for i in b) for b in batches if b)
