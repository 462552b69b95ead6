"""Prefix planner: a token trie over a shard's prompts, depth-first admission order and warm-up points.

Pure logic, no MLX. Prompts are compared by their keys (prompts.py), whose byte order is position order, so
sorting and comparing them runs in C. A depth-first walk of the trie visits prompts in sorted order, so the
trie is never built node by node: its branch nodes are the LCP intervals of the sorted keys.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from omlx_jobs import defaults
from omlx_jobs.worker.prompts import common_prefix, positions


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


def plan(keys: Sequence[bytes], min_shared_tokens: int = defaults.MIN_SHARED_TOKENS, min_added_tokens: int = 1) -> Plan:
    """Plan admission for sequences with prompt `keys` (prompts.token_key). Identical keys share the whole prompt.

    A warm-up point is a trie node shared by at least two sequences and at least `min_shared_tokens` deep,
    or a prompt that several sequences have in full (any length). A node nested in another warm-up must also add
    `min_added_tokens` to it: each warm-up holds a copy of its whole prefix, so a few shared tokens after a long
    document (questions that begin alike) would cost a document's copy per node to save a few tokens per row.
    """
    n = len(keys)
    order = sorted(range(n), key=keys.__getitem__)
    lengths = [positions(keys[i]) for i in order]
    lcp = [0] * (n + 1)  # lcp[i]: common prefix of order[i-1] and order[i]; lcp[0] = lcp[n] = 0
    for i in range(1, n):
        lcp[i] = common_prefix(keys[order[i - 1]], keys[order[i]])
    trie_min = sum(lengths[i] - lcp[i] for i in range(n))

    # Enumerate LCP intervals (depth, lb, rb) with a stack; each is a branch node of the trie.
    warmups: list[WarmUp] = []
    stack: list[tuple[int, int]] = [(0, 0)]
    for i in range(1, n + 1):
        cur = lcp[i] if i < n else 0
        lb = i - 1
        while cur < stack[-1][0]:
            depth, lb = stack.pop()
            # Identical prompts (n > 1, repeated lines) share their whole prompt however short it is.
            identical = keys[order[lb]] == keys[order[i - 1]]
            if depth >= min_shared_tokens or identical:
                warmups.append(WarmUp(depth=depth, first=lb, last=i - 1))
        if cur > stack[-1][0]:
            stack.append((cur, lb))
    warmups.sort(key=lambda w: (w.first, w.depth))
    if min_added_tokens > 1:
        whole = {w for w in warmups if w.depth == lengths[w.first] and w.depth == lengths[w.last]}
        warmups = _enough_added(warmups, min_added_tokens, keep=whole)
    return Plan(order=order, warmups=warmups, trie_min_tokens=trie_min, prompt_tokens=sum(lengths))


def _enough_added(warmups: list[WarmUp], min_added: int, keep: set[WarmUp]) -> list[WarmUp]:
    """The warm-ups (sorted by (first, depth)) that add at least `min_added` tokens to the nearest kept warm-up
    enclosing them; those in `keep` (prompts several sequences have in full: they start from cached logits) stay."""
    kept: list[WarmUp] = []
    stack: list[WarmUp] = []
    for w in warmups:
        while stack and not (stack[-1].first <= w.first and w.last <= stack[-1].last):
            stack.pop()
        if stack and w.depth - stack[-1].depth < min_added and w not in keep:
            continue
        kept.append(w)
        stack.append(w)
    return kept


@dataclass(frozen=True)
class WarmupTask:
    """Compute `node`'s prefix in one pass; each of `derived` (ancestors on a single-child chain above it,
    shallow first) is taken from the same pass as a shorter view, with the logits at its end."""

    node: WarmUp
    derived: tuple[WarmUp, ...] = ()


def warmup_rounds(warmups: Sequence[WarmUp], *, fold_chains: bool = True) -> list[list[WarmupTask]]:
    """Plan how to compute a set of warm-ups in as few passes as possible, each round one batch.

    Nested warm-ups form a forest. A node with two or more nested warm-ups is computed on its own, so its
    tokens are computed once for all of them; a node with exactly one is folded into that one's pass (its
    cache is a prefix of the deeper one's; needs trimmable caches, else `fold_chains=False`). Rounds order
    passes so each starts from a cached ancestor.
    """
    ws = sorted(set(warmups), key=lambda w: (w.first, w.depth))
    parent: dict[WarmUp, WarmUp | None] = {}
    stack: list[WarmUp] = []
    for w in ws:  # sorted by (first, depth): enclosing intervals come first
        while stack and not (stack[-1].first <= w.first and w.last <= stack[-1].last and stack[-1].depth < w.depth):
            stack.pop()
        parent[w] = stack[-1] if stack else None
        stack.append(w)
    children: dict[WarmUp, list[WarmUp]] = {w: [] for w in ws}
    for w, p in parent.items():
        if p is not None:
            children[p].append(w)
    computed = [w for w in ws if len(children[w]) != 1 or not fold_chains]
    round_of: dict[WarmUp, int] = {}
    tasks: list[list[WarmupTask]] = []
    for w in sorted(computed, key=lambda w: w.depth):
        derived = []
        p = parent[w]
        while p is not None and len(children[p]) == 1 and fold_chains:
            derived.append(p)
            p = parent[p]
        lv = round_of[p] + 1 if p is not None else 0
        round_of[w] = lv
        while len(tasks) <= lv:
            tasks.append([])
        tasks[lv].append(WarmupTask(w, tuple(reversed(derived))))
    return tasks
