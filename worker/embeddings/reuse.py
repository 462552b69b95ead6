"""Prefix reuse for a causal embedding model: a group's shared prefix (prefix.py) runs once into KV caches, its
hidden states kept for a mean, and each batch of the members' own suffixes runs from those caches, broadcast to
every row.

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
from mlx_lm.models.cache import KVCache

from omlx_jobs.worker.embeddings.runner import masked_sum, right_pad

Extend = Callable[[mx.array, list[Any]], mx.array]
"""(token ids (B, L), the model's KV caches, extended in place) -> hidden states (B, L, D)."""
NewCache = Callable[[], list[Any]]
"""The model's empty KV caches (one per layer): plain KVCache only, so they can be copied per row."""
REUSE_POOLINGS = ("lasttoken", "mean")


class _FromPrefix(KVCache):
    """A KV cache holding a prefix's keys and values for every row (broadcast, not copied), extended once by the
    suffixes: one concatenation, where KVCache would allocate its 256-position steps and copy into them."""

    def __init__(self, keys: mx.array, values: mx.array) -> None:
        super().__init__()
        self.keys, self.values, self.offset = keys, values, keys.shape[2]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.keys = mx.concatenate([self.keys, keys], axis=2)
        self.values = mx.concatenate([self.values, values], axis=2)
        self.offset += keys.shape[2]
        return self.keys, self.values


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
    caches = [
        _FromPrefix(mx.broadcast_to(k, (rows, *k.shape[1:])), mx.broadcast_to(v, (rows, *v.shape[1:])))
        for k, v in zip(prefix.keys, prefix.values, strict=True)
    ]
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
