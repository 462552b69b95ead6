"""Verification of one row's drafts from the target model's log-probabilities at its k + 1 input positions.

The row's inputs were its pending token then its k drafts; `logprobs[j]` is the model's (normalised) distribution
for the token after input j. Greedy rows compare drafts with the argmax (acceptance.greedy_accepted); sampled
rows accept draft x with probability p(x) under their sampler's processed distribution, and on rejection draw
from p with x removed (acceptance.py says why that is exact). Either way the row gets its accepted drafts and one
token of the model's own after them: Verdict.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mlx.core as mx

from omlx_jobs.worker.speculation.acceptance import greedy_accepted, sampled_accepted

Filtered = Callable[[mx.array], mx.array]
"""A sampler's processing: log-probabilities -> the logits it draws from (filters and temperature applied)."""


@dataclass(frozen=True)
class Verdict:
    accepted: int
    """Drafts kept (a prefix of them)."""
    token: int
    """The model's own token after them: the row's next pending token."""


def greedy(drafts: Sequence[int], argmax: Sequence[int]) -> Verdict:
    """`argmax[j]`: the argmax after input position j (len(drafts) + 1 of them)."""
    a = greedy_accepted(drafts, argmax)
    return Verdict(a, int(argmax[a]))


def sampled(drafts: Sequence[int], logprobs: mx.array, filtered: Filtered, key: mx.array | None = None) -> Verdict:
    """Exact speculative sampling for point-mass drafts. `logprobs`: [k + 1, V]; `key`: None for the global
    random state (the row's draws then follow everything else drawn), or an explicit key (tests)."""
    k = len(drafts)
    logits = filtered(logprobs[: k + 1])
    keys = mx.random.split(key, 2) if key is not None else (None, None)
    a = 0
    if k:
        probs = mx.softmax(logits[:k], axis=-1)
        p = mx.take_along_axis(probs, mx.array(drafts)[:, None], axis=-1)[:, 0]
        u = mx.random.uniform(shape=(k,), key=keys[0])
        a = sampled_accepted(p.tolist(), u.tolist())
    row = logits[a]
    if a < k:  # rejected: draw from p without the draft
        row = mx.where(mx.arange(row.shape[-1]) == drafts[a], -mx.inf, row)
    token = mx.random.categorical(row, key=keys[1])
    return Verdict(a, int(token.item()))
