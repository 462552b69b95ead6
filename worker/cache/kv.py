"""KV cache views over mlx-lm's public cache classes: cheap prefixes of cached entries, and their sizes.

Running the model over caches (prefill, decode) is backend/'s.
"""

from __future__ import annotations

import copy
from typing import Any

from mlx_lm.models.cache import KVCache

Caches = list[Any]


def view(caches: Caches, tokens: int, length: int) -> Caches:
    """Per-layer caches holding the first `length` of `tokens` cached tokens, safe to hand to BatchGenerator.

    BatchGenerator copies caches when it merges a batch, so a KVCache view is a slice, not a copy.
    """
    out = []
    for c in caches:
        if isinstance(c, KVCache):
            v = copy.copy(c)  # keeps a subclass and its state (a vision model's RoPE breaks)
            v.keys = v.values = None
            if length:
                v.keys = c.keys[..., :length, :]
                v.values = c.values[..., :length, :]
            v.offset = length
            out.append(v)
        else:
            v = copy.copy(c)
            if length < tokens:
                v.trim(tokens - length)
            out.append(v)
    return out


def extendable(caches: Caches, tokens: int, length: int) -> Caches:
    """A copy of the first `length` tokens that the model may extend without touching `caches`."""
    if all(isinstance(c, KVCache) for c in caches):
        return view(caches, tokens, length)  # extending a slice allocates new arrays
    return [copy.deepcopy(c) for c in view(caches, tokens, length)]


def nbytes(caches: Caches) -> int:
    return int(sum(c.nbytes for c in caches))
