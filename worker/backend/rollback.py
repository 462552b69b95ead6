"""Per-row KV-cache rollback for speculative verification: drop each row's last `r` positions of the batch cache.

A verification step appends the same number of positions W to every row of mlx-lm's BatchKVCache (one shared
index, rows left-padded); a row that keeps fewer gives the rest back here. The positions every row rejects are
trimmed off the end (BatchKVCache.trim); a row rejecting `x` more than that is shifted right by `x` within the
buffer and its left padding grows by `x`, as BatchKVCache.finalize does for right padding (mlx-lm 0.32.2), so
its kept positions end at the shared index again and its offset (RoPE position) is back where it was. Cascade
caches roll back their rows' own suffixes only: the shared prefix levels are never written by a decode step.
Recurrent caches (ArraysCache: mamba, Qwen3.5's linear attention) cannot be rolled back: `supported` says no and
speculation stays off for such models.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, dynamic_roll

from omlx_jobs.worker.backend.cascade_cache import CascadeKVCache


def supported(caches: Sequence[Any]) -> bool:
    """Whether every layer's batch cache can be rolled back per row."""
    return bool(caches) and all(isinstance(_own(c), BatchKVCache) for c in caches)


def roll_back(caches: Sequence[Any], rejected: Sequence[int]) -> None:
    """Drop the last `rejected[i]` positions of row i in every layer's cache."""
    common = min(rejected)
    extra = [r - common for r in rejected]
    shift = mx.array(extra) if any(extra) else None
    for c in caches:
        own = _own(c)
        if common:
            own.trim(common)
        if shift is not None:
            idx = own._idx
            own.keys = dynamic_roll(own.keys[..., :idx, :], shift[:, None], axis=2)
            own.values = dynamic_roll(own.values[..., :idx, :], shift[:, None], axis=2)
            own.offset = own.offset - shift
            own.left_padding = own.left_padding + shift


def row_positions(cache: Any) -> list[int]:
    """Each row's positions in one layer's own cache (for tests: what it holds after a rollback)."""
    own = _own(cache)
    return [own._idx - p for p in own.left_padding.tolist()]


def row_keys(cache: Any, row: int) -> mx.array:
    """Row `row`'s keys in one layer's own cache, padding left out: [heads, positions, dim] (for tests)."""
    own = _own(cache)
    pad = own.left_padding.tolist()[row]
    return own.keys[row, :, pad : own._idx, :]


def _own(c: Any) -> Any:
    return c.own if isinstance(c, CascadeKVCache) else c
