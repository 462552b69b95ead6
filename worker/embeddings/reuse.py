"""Prefix reuse for a causal embedding model: a group's shared prefix (prefix.py) runs once into KV caches, its
hidden states kept for a mean, and each batch of the members' own suffixes runs from those caches, copied per row.

Exact on causal attention: a prefix position attends only to positions before it, so its keys, values and hidden
states are the same whatever follows. Never used for an encoder (bidirectional: every position sees the end).
Suffixes are right-padded as in runner.py: no real position attends to a pad after it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from omlx_jobs.worker.embeddings.runner import masked_sum, right_pad

Extend = Callable[[mx.array, list[Any]], mx.array]
"""(token ids (B, L), the model's KV caches, extended in place) -> hidden states (B, L, D)."""
NewCache = Callable[[], list[Any]]
"""The model's empty KV caches (one per layer): plain KVCache only, so they can be copied per row."""
REUSE_POOLINGS = ("lasttoken", "mean")


@dataclass
class Prefix:
    """A shared prefix, computed: its per-layer keys and values (batch 1) and its hidden states (P, D) float32."""

    keys: list[mx.array]
    values: list[mx.array]
    hidden: mx.array

    @property
    def length(self) -> int:
        return int(self.hidden.shape[0])


def run_prefix(extend: Extend, new_cache: NewCache, tokens: Sequence[int]) -> Prefix:
    """The prefix `tokens` run once through the model."""
    caches = new_cache()
    hidden = extend(mx.array([list(tokens)]), caches)[0].astype(mx.float32)
    keys = [c.state[0][..., : len(tokens), :] for c in caches]
    values = [c.state[1][..., : len(tokens), :] for c in caches]
    mx.eval(hidden, keys, values)
    return Prefix(keys, values, hidden)


def embed_suffixes(
    extend: Extend,
    new_cache: NewCache,
    prefix: Prefix,
    suffixes: Sequence[Sequence[int]],
    pooling: str,
    *,
    starts: Sequence[int] | None = None,
    pad_id: int = 0,
    pad_to: int = 1,
) -> tuple[np.ndarray, int]:
    """Pooled vectors (B, D) float32 of prefix + each suffix, in one forward pass over the suffixes from copies of
    the prefix's caches; and the padded suffix positions computed. `starts`: as runner.pool's, counted from the
    prefix's first token."""
    ids, _ = right_pad(suffixes, pad_id, pad_to)
    rows, n = len(suffixes), prefix.length
    caches = new_cache()
    for c, k, v in zip(caches, prefix.keys, prefix.values, strict=True):
        c.state = (mx.repeat(k, rows, axis=0), mx.repeat(v, rows, axis=0), n)
    hidden = extend(mx.array(ids), caches).astype(mx.float32)
    lengths = mx.array([len(s) for s in suffixes])
    if pooling == "lasttoken":
        pooled = hidden[mx.arange(rows), lengths - 1]
    else:
        begin = mx.array(list(starts) if starts is not None else [0] * rows)
        own = masked_sum(hidden, mx.maximum(begin - n, 0), lengths)
        shared = (mx.arange(n)[None, :] >= begin[:, None]).astype(mx.float32) @ prefix.hidden  # prefix rows, once
        pooled = (own + shared) / (lengths + n - begin)[:, None].astype(mx.float32)
    mx.eval(pooled)
    return np.array(pooled, dtype=np.float32), int(ids.size)
