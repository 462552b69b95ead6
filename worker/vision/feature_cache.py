"""Vision features cached by image digest, bounded in bytes: many questions about one image encode it once.

A plain LRU over any value with `nbytes` (mx.array features and their grid); no MLX imported here. An entry larger
than the whole budget is computed and returned but not kept.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

DEFAULT_FEATURE_CACHE_BYTES = 512 * 1024**2


class Sized(Protocol):
    @property
    def nbytes(self) -> int: ...


V = TypeVar("V", bound=Sized)


@dataclass
class FeatureCacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    encoder_calls: int = 0
    """Times the vision encoder ran (misses, plus every call while the cache is off)."""


class FeatureCache(Generic[V]):
    """LRU of vision features keyed by image digest, holding at most `max_bytes` (0 turns it off)."""

    def __init__(self, max_bytes: int = DEFAULT_FEATURE_CACHE_BYTES) -> None:
        if max_bytes < 0:
            raise ValueError("the feature cache size must be >= 0")
        self.max_bytes = max_bytes
        self.stats = FeatureCacheStats()
        self._entries: OrderedDict[bytes, V] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._entries

    @property
    def nbytes(self) -> int:
        return self._bytes

    def get_or_compute(self, digest: bytes, compute: Callable[[], V]) -> V:
        """The cached features of `digest`, or compute (run the encoder), keep if they fit, and return them."""
        value = self._entries.get(digest)
        if value is not None:
            self._entries.move_to_end(digest)
            self.stats.hits += 1
            return value
        self.stats.misses += 1
        self.stats.encoder_calls += 1
        value = compute()
        self._put(digest, value)
        return value

    def _put(self, digest: bytes, value: V) -> None:
        size = int(value.nbytes)
        if size > self.max_bytes:
            return
        while self._entries and self._bytes + size > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self._bytes -= int(old.nbytes)
            self.stats.evictions += 1
        self._entries[digest] = value
        self._bytes += size

    def clear(self) -> None:
        self._entries.clear()
        self._bytes = 0

    def snapshot(self) -> dict[str, Any]:
        s = self.stats
        return {
            "hits": s.hits,
            "misses": s.misses,
            "evictions": s.evictions,
            "encoder_calls": s.encoder_calls,
            "entries": len(self._entries),
            "bytes": self._bytes,
        }
