"""Acceptance rules for drafted tokens. Pure: no MLX (probabilities and uniform draws come in as floats).

Greedy: a drafted token is right when it is the model's argmax there; the row keeps the longest right prefix,
then the model's own token after it. Sampled (the drafts are a point mass, as an n-gram proposer's are): draft x
is accepted with probability p(x) under the row's processed distribution; on rejection the row's token there is
drawn from p with x removed and renormalised. Together each position's token has exactly distribution p
(speculative sampling with q = delta_x): P(x) = p(x), and P(y) = (1 - p(x)) * p(y) / (1 - p(x)) for y != x.
"""

from __future__ import annotations

from collections.abc import Sequence


def greedy_accepted(drafts: Sequence[int], argmax: Sequence[int]) -> int:
    """How many drafts are right: argmax[j] is the model's token after the row's input position j."""
    n = 0
    for d, t in zip(drafts, argmax, strict=False):
        if d != t:
            break
        n += 1
    return n


def sampled_accepted(probs: Sequence[float], uniforms: Sequence[float]) -> int:
    """How many drafts are accepted: probs[j] is p(draft j) at its position, uniforms[j] a draw from [0, 1)."""
    n = 0
    for p, u in zip(probs, uniforms, strict=False):
        if u >= p:
            break
        n += 1
    return n
