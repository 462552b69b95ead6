"""In-memory prefix cache: longest-prefix lookup, byte budget, finished-subtree-first then LRU eviction.

Pure policy over opaque values (the engine stores mlx-lm KV caches in them), so it is tested without MLX.
Keys are token keys (see planner.token_key).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from omlx_jobs.worker.planner import common_prefix_tokens

DEFAULT_CACHE_MEMORY = 2 * 1024**3


@dataclass(eq=False)
class Entry:
    key: bytes
    value: Any
    nbytes: int
    needed_until: int = -1
    """Last admission position that needs this prefix; past it, the entry's subtree is finished."""
    logits: Any = None
    """Logits after the last prefix token, when known: a request whose whole prompt is the key can start
    generating from them without recomputing its last token."""
    last_used: int = 0
    pins: int = 0

    @property
    def tokens(self) -> int:
        return len(self.key) // 4


@dataclass(frozen=True)
class Match:
    entry: Entry
    length: int
    """Tokens of the entry to reuse; shorter than the entry when it is trimmed."""


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes: int = 0
    peak_bytes: int = 0

    def snapshot(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass
class PrefixCache:
    """Entries bounded by `max_bytes` (None: unbounded). Pinned entries (in use right now) are never evicted."""

    max_bytes: int | None = DEFAULT_CACHE_MEMORY
    trimmable: bool = True
    bucket_tokens: int = 16
    """Entries are indexed by their first tokens; shorter shared prefixes are not worth a lookup."""
    position: int = 0
    stats: CacheStats = field(default_factory=CacheStats)
    _entries: dict[bytes, Entry] = field(default_factory=dict)
    _buckets: dict[bytes, list[Entry]] = field(default_factory=dict)
    _clock: itertools.count = field(default_factory=itertools.count)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def entries(self) -> list[Entry]:
        return list(self._entries.values())

    def get(self, key: bytes) -> Entry | None:
        return self._entries.get(key)

    def _bucket(self, key: bytes) -> bytes | None:
        n = self.bucket_tokens * 4
        return key[:n] if len(key) >= n else None

    def lookup(self, key: bytes, limit: int | None = None, *, count: bool = True) -> Match | None:
        """The entry sharing the longest prefix with `key`, reusing at most `limit` tokens.

        Without trimmable caches only entries that are whole prefixes of `key` (and fit `limit`) match.
        """
        bucket = self._bucket(key)
        limit = len(key) // 4 if limit is None else limit
        best: Match | None = None
        exact = self._entries.get(key)  # a whole prompt cached as is (identical prompts), however short
        if exact is not None and (self.trimmable or exact.tokens <= limit) and min(exact.tokens, limit) > 0:
            best = Match(exact, min(exact.tokens, limit))
        for entry in self._buckets.get(bucket, ()) if bucket is not None else ():
            shared = common_prefix_tokens(entry.key, key)
            if self.trimmable:
                use = min(shared, limit)
            elif shared == entry.tokens and entry.tokens <= limit:
                use = shared
            else:
                continue
            # Among equal matches prefer an entry that ends exactly there: it may carry the logits after it.
            better = best is None or use > best.length or (use == best.length and entry.tokens == use)
            if use >= self.bucket_tokens and better:
                best = Match(entry, use)
        if count:
            if best is None:
                self.stats.misses += 1
            else:
                self.stats.hits += 1
                best.entry.last_used = next(self._clock)
        return best

    def add(
        self,
        key: bytes,
        value: Any,
        nbytes: int,
        *,
        needed_until: int = -1,
        logits: Any = None,
        pin: bool = False,
    ) -> Entry:
        """Insert (or replace) an entry, optionally pinned, then evict others to fit the budget."""
        old = self._entries.get(key)
        if old is not None:
            self._remove(old)
        entry = Entry(key, value, nbytes, needed_until=needed_until, logits=logits, last_used=next(self._clock))
        entry.pins = int(pin)
        self._entries[key] = entry
        bucket = self._bucket(key)
        if bucket is not None:
            self._buckets.setdefault(bucket, []).append(entry)
        self.stats.bytes += nbytes
        self.stats.peak_bytes = max(self.stats.peak_bytes, self.stats.bytes)
        self.evict_to_fit(keep=entry)
        return entry

    def pin(self, entry: Entry) -> None:
        entry.pins += 1

    def unpin(self, entry: Entry) -> None:
        entry.pins = max(0, entry.pins - 1)

    def advance(self, position: int) -> None:
        """Admission has reached `position`: entries needed only before it now hold finished subtrees."""
        self.position = position

    def eviction_order(self) -> list[Entry]:
        """Unpinned entries, finished subtrees first, then least recently used."""
        candidates = [e for e in self._entries.values() if e.pins == 0]
        return sorted(candidates, key=lambda e: (e.needed_until >= self.position, e.last_used))

    def evict_to_fit(self, keep: Entry | None = None) -> list[Entry]:
        evicted: list[Entry] = []
        if self.max_bytes is None:
            return evicted
        for entry in self.eviction_order():
            if self.stats.bytes <= self.max_bytes:
                break
            if entry is keep:
                continue
            self._remove(entry)
            self.stats.evictions += 1
            evicted.append(entry)
        if self.stats.bytes > self.max_bytes and keep is not None and keep.pins == 0 and keep.key in self._entries:
            # Too big to keep even alone; the caller holds it only while it is in use.
            self._remove(keep)
            self.stats.evictions += 1
            evicted.append(keep)
        return evicted

    def _remove(self, entry: Entry) -> None:
        del self._entries[entry.key]
        bucket = self._bucket(entry.key)
        if bucket is not None:
            self._buckets[bucket].remove(entry)
            if not self._buckets[bucket]:
                del self._buckets[bucket]
        self.stats.bytes -= entry.nbytes

    def discard(self, key: bytes) -> None:
        entry = self._entries.get(key)
        if entry is not None:
            self._remove(entry)

    def clear(self) -> None:
        for entry in list(self._entries.values()):
            self._remove(entry)
