"""Prefix planner: a token trie over a shard's prompts, depth-first admission order and warm-up points.

Pure logic, no MLX. Prompts are keyed as big-endian uint32 bytes, so byte order is token order and
sorting or comparing them runs in C. A depth-first walk of the trie visits prompts in sorted order, so
the trie is never built node by node: its branch nodes are the LCP intervals of the sorted keys.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_MIN_SHARED_TOKENS = 16


def token_key(tokens: Sequence[int]) -> bytes:
    """Tokens as big-endian uint32 bytes: byte-wise order equals token-wise lexicographic order."""
    return struct.pack(f">{len(tokens)}I", *tokens)


def key_tokens(key: bytes) -> list[int]:
    return list(struct.unpack(f">{len(key) // 4}I", key))


def common_prefix_tokens(a: bytes, b: bytes) -> int:
    """Length in tokens of the common prefix of two keys (binary search over C-level slice compares)."""
    hi = min(len(a), len(b)) // 4
    if a[: hi * 4] == b[: hi * 4]:
        return hi
    lo = 0  # a[:lo] == b[:lo] holds; a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[: mid * 4] == b[: mid * 4]:
            lo = mid
        else:
            hi = mid
    return lo


@dataclass(frozen=True)
class WarmUp:
    """Prefill `depth` tokens once before positions first..last (inclusive) of the order are admitted."""

    depth: int
    first: int
    last: int


@dataclass(frozen=True)
class Plan:
    order: list[int]
    """Sequence indices in depth-first (sorted) order: requests sharing a prefix run together."""
    warmups: list[WarmUp]
    """Branch nodes worth prefilling once, sorted by (first, depth): parents before children."""
    trie_min_tokens: int
    """Distinct prompt tokens: the least prefill any engine must compute for these prompts."""
    prompt_tokens: int
    """Prompt tokens over all sequences, as if nothing were shared."""

    def warmups_starting_at(self) -> dict[int, list[WarmUp]]:
        out: dict[int, list[WarmUp]] = {}
        for w in self.warmups:
            out.setdefault(w.first, []).append(w)
        return out


def plan(keys: Sequence[bytes], min_shared_tokens: int = DEFAULT_MIN_SHARED_TOKENS) -> Plan:
    """Plan admission for sequences with prompt `keys` (see token_key). Identical keys share the whole prompt.

    A warm-up point is a trie node shared by at least two sequences and at least `min_shared_tokens` deep.
    """
    n = len(keys)
    order = sorted(range(n), key=keys.__getitem__)
    lengths = [len(keys[i]) // 4 for i in order]
    lcp = [0] * (n + 1)  # lcp[i]: common prefix of order[i-1] and order[i]; lcp[0] = lcp[n] = 0
    for i in range(1, n):
        lcp[i] = common_prefix_tokens(keys[order[i - 1]], keys[order[i]])
    trie_min = sum(lengths[i] - lcp[i] for i in range(n))

    # Enumerate LCP intervals (depth, lb, rb) with a stack; each is a branch node of the trie.
    warmups: list[WarmUp] = []
    stack: list[tuple[int, int]] = [(0, 0)]
    for i in range(1, n + 1):
        cur = lcp[i] if i < n else 0
        lb = i - 1
        while cur < stack[-1][0]:
            depth, lb = stack.pop()
            if depth >= min_shared_tokens:
                warmups.append(WarmUp(depth=depth, first=lb, last=i - 1))
        if cur > stack[-1][0]:
            stack.append((cur, lb))
    warmups.sort(key=lambda w: (w.first, w.depth))
    return Plan(order=order, warmups=warmups, trie_min_tokens=trie_min, prompt_tokens=sum(lengths))


def rounds(warmups: Sequence[WarmUp]) -> list[list[WarmUp]]:
    """Split warm-ups into rounds that can each be computed as one batch: a warm-up nested inside another
    (its ancestor in the trie) extends the ancestor's cache, so it comes in a later round."""
    out: list[list[WarmUp]] = []
    level: dict[WarmUp, int] = {}
    for w in sorted(warmups, key=lambda w: (w.depth, w.first)):
        parents = [level[p] for p in level if p.first <= w.first and w.last <= p.last and p.depth < w.depth]
        lv = max(parents, default=-1) + 1
        level[w] = lv
        while len(out) <= lv:
            out.append([])
        out[lv].append(w)
    return out
