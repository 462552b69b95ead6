"""A KVCache that carries a vision prompt's RoPE breaks: where text after an image runs behind its index.

Qwen2-VL's mRoPE gives image tokens 2-D positions, so after an image a token's rotary position is its index
plus a per-request delta (<= 0). The cache of such a prompt carries the delta after each image (`breaks`), so a
cached prefix of any length knows its own, the disk tier saves and restores it (cache/disk.py), and
BatchGenerator's merge turns it into the row's position offset (vision/prefill.py computes the breaks).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache


class PositionedKVCache(KVCache):
    """A KVCache whose next RoPE position is its length plus a RoPE delta (mRoPE after images; 0 for text).

    `breaks` holds (position, delta) pairs in order: text from `position` on runs `delta` behind its index (a
    position just after an image). The delta is read at the cache's own length, so a view of a shorter
    prefix (kv.view keeps the class) gets the delta of that prefix, however long the entry it was cut from.
    BatchGenerator merges a batch's caches with `caches[0][i].merge(...)`, so every cache of a vision model's
    rows must be of this class (the decode model's make_cache and `positioned` see to it).
    """

    def __init__(self, breaks: tuple[tuple[int, int], ...] = ()) -> None:
        super().__init__()
        self.breaks = breaks

    @property
    def rope_delta(self) -> int:
        delta = 0
        for position, d in self.breaks:
            if position > self.offset:
                break
            delta = d
        return delta

    @classmethod
    def merge(cls, caches: list[Any]) -> BatchKVCache:
        batch = BatchKVCache.merge(caches)
        deltas = [int(getattr(c, "rope_delta", 0)) for c in caches]
        if any(deltas):
            # A BatchKVCache row's offset is only its RoPE position: masks use left_padding, and filter,
            # extend and trim shift it by whole tokens, so the delta stays with the row.
            batch.offset = batch.offset + mx.array(deltas)
        return batch


def positioned(caches: list[Any], breaks: tuple[tuple[int, int], ...] = ()) -> list[Any]:
    """The same keys and values (no copy) as PositionedKVCache layers carrying `breaks`. Caches with other layer
    kinds and no breaks (a family with 1-D RoPE and rotating layers) come back as they are."""
    if not breaks and any(type(c) not in (KVCache, PositionedKVCache) for c in caches):
        return caches  # sliding-window layers (Gemma 3): mlx-lm's own caches, at text positions throughout
    out = []
    for c in caches:
        if type(c) not in (KVCache, PositionedKVCache):
            raise TypeError(f"{type(c).__name__} layers cannot carry a RoPE delta; only KVCache layers can")
        p = PositionedKVCache(breaks)
        p.keys, p.values, p.offset = c.keys, c.values, c.offset
        out.append(p)
    return out


def breaks_of(caches: list[Any] | None) -> tuple[tuple[int, int], ...]:
    """The RoPE breaks of the tokens caches hold (a view of a longer entry may carry some beyond its end,
    which must not travel on when it is extended by other tokens); none for plain caches."""
    if not caches:
        return ()
    return tuple((p, d) for p, d in getattr(caches[0], "breaks", ()) if p <= caches[0].offset)
