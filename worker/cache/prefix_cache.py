"""In-memory prefix cache: longest-prefix lookup, byte budget, finished-subtree-first then LRU eviction.

Pure policy over opaque values (the engine stores mlx-lm KV caches in them), so it is tested without MLX.
Keys are prompt keys (prompts.py). Which entries the run still needs or holds is kept by `lifetimes`
(lifetimes.py), the only writer of an entry's `needed_until` and `pins`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from omlx_jobs import defaults
from omlx_jobs.worker.cache.lifetimes import Hold, Lifetimes
from omlx_jobs.worker.prompts import common_prefix, key_prefix, positions


@dataclass(eq=False)
class Entry:
    key: bytes
    value: Any
    nbytes: int
    needed_until: int = -1
    """Last admission position that needs this prefix; past it, the entry's subtree is finished (lifetimes.py)."""
    logits: Any = None
    """Logits after the last prefix token, when known: a request whose whole prompt is the key can start
    generating from them without recomputing its last token."""
    last_used: int = 0
    pins: int = 0
    """Holds on this entry (lifetimes.py); a pinned entry is in use and never evicted."""

    @property
    def tokens(self) -> int:
        return positions(self.key)


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

    max_bytes: int | None = defaults.CACHE_MEMORY
    trimmable: bool = True
    bucket_tokens: int = 16
    """Entries are indexed by their first tokens; shorter shared prefixes are not worth a lookup."""
    lifetimes: Lifetimes[Entry] = field(default_factory=Lifetimes)
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
        return key_prefix(key, self.bucket_tokens) if positions(key) >= self.bucket_tokens else None

    def lookup(self, key: bytes, limit: int | None = None, *, count: bool = True) -> Match | None:
        """The entry sharing the longest prefix with `key`, reusing at most `limit` tokens.

        Without trimmable caches only entries that are whole prefixes of `key` (and fit `limit`) match.
        """
        bucket = self._bucket(key)
        limit = positions(key) if limit is None else limit
        best: Match | None = None
        exact = self._entries.get(key)  # a whole prompt cached as is (identical prompts), however short
        if exact is not None and (self.trimmable or exact.tokens <= limit) and min(exact.tokens, limit) > 0:
            best = Match(exact, min(exact.tokens, limit))
        for entry in self._buckets.get(bucket, ()) if bucket is not None else ():
            shared = common_prefix(entry.key, key)
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

    def prefixes_of(self, key: bytes, below: int) -> list[Entry]:
        """Entries whose whole key is a prefix of `key` shorter than `below` positions, shortest first (the cached
        ancestors along a trie path, such as a system prompt's entry before a document's)."""
        bucket = self._bucket(key)
        found = [e for e in self._buckets.get(bucket, ()) if e.tokens < below and key.startswith(e.key)]
        return sorted(found, key=lambda e: e.tokens)

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
        """Insert (or replace) an entry needed until `needed_until` (pinned until then if `pin`), then evict
        others to fit the budget."""
        old = self._entries.get(key)
        if old is not None:
            self._remove(old)
        entry = Entry(key, value, nbytes, logits=logits, last_used=next(self._clock))
        if pin:
            self.lifetimes.hold(entry, needed_until)
        else:
            self.lifetimes.need(entry, needed_until)
        self._entries[key] = entry
        bucket = self._bucket(key)
        if bucket is not None:
            self._buckets.setdefault(bucket, []).append(entry)
        self.stats.bytes += nbytes
        self.stats.peak_bytes = max(self.stats.peak_bytes, self.stats.bytes)
        self.evict_to_fit(keep=entry)
        return entry

    def hold(self, entry: Entry, until: int | None) -> Hold[Entry]:
        """Pin an entry (a warm-up found it cached) until admission passes position `until`."""
        return self.lifetimes.hold(entry, until)

    def unpin(self, entry: Entry) -> None:
        """Drop one hold now; raises LifetimeError if the entry is not held."""
        self.lifetimes.release_entry(entry)

    def start_run(self) -> None:
        """A new run: no entry is needed by it yet, and none may still be held."""
        self.lifetimes.start_run(self._entries.values())

    def advance(self, position: int) -> None:
        """Admission has reached `position`: groups that ended before it release their entries, which may go."""
        if self.lifetimes.advance(position):
            self.evict_to_fit()

    def end_run(self) -> None:
        """The run ended, or failed: release every hold, drop the entries under another one, then fit the budget.

        What a later run (the next shard of a prefix group, a later job) reuses is the top of each tree: the
        system prompt, the instruction. The nodes under it were its groups' own, so keeping them would make a
        worker's memory grow with every shard it runs until the byte budget (bench/RESULTS.md, issue 10)."""
        self.lifetimes.release_all()
        self.drop_descendants()
        self.evict_to_fit()

    def drop_descendants(self) -> list[Entry]:
        """Remove every unpinned entry whose key extends another entry's. In key order an entry's descendants
        follow it, before any key that does not extend it, so one pass finds them."""
        dropped: list[Entry] = []
        top: bytes | None = None
        for key in sorted(self._entries):
            if top is not None and key.startswith(top) and self._entries[key].pins == 0:
                dropped.append(self._entries[key])
            elif top is None or not key.startswith(top):
                top = key
        for entry in dropped:
            self._remove(entry)
        return dropped

    def eviction_order(self) -> list[Entry]:
        """Unpinned entries, finished subtrees first, then least recently used."""
        candidates = [e for e in self._entries.values() if e.pins == 0]
        return sorted(candidates, key=lambda e: (not self.lifetimes.finished(e), e.last_used))

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
