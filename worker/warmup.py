"""Warm-ups: prefill each shared prefix once and keep it in the prefix cache (memory, and disk if set).

The planner says which prefixes a window of upcoming requests shares; this computes the missing ones in
batched passes (see planner.warmup_rounds) and pins every entry until its group has been admitted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from omlx_jobs.worker import kv, planner
from omlx_jobs.worker.disk_cache import DiskCache
from omlx_jobs.worker.prefix_cache import Entry, Match, PrefixCache


@dataclass
class WarmupStats:
    warmups: int = 0
    tokens: int = 0
    """Prompt tokens computed by warm-ups."""
    seconds: float = 0.0
    disk_hits: int = 0


class WarmUps:
    def __init__(
        self,
        model: Any,
        cache: PrefixCache,
        disk: DiskCache | None,
        *,
        trimmable: bool,
        batch_size: int,
        step: int,
        min_tokens: int,
    ) -> None:
        self.model, self.cache, self.disk = model, cache, disk
        self.trimmable, self.batch_size, self.step, self.min_tokens = trimmable, batch_size, step, min_tokens
        self.stats = WarmupStats()

    def ensure(self, wanted: list[tuple[planner.WarmUp, bytes]], stream: Any) -> list[tuple[Entry, int]]:
        """Make sure each warm-up's prefix is cached, computing only what no entry (memory or disk) holds.

        Passes run in batches of prefill_batch_size; a chain of nested warm-ups is one pass (see
        planner.warmup_rounds). Every entry is pinned until its group is admitted; returns (entry, last).
        """
        key_of = dict(wanted)
        pinned: list[tuple[Entry, int]] = []
        for round_ in planner.warmup_rounds(list(key_of), fold_chains=self.trimmable):
            todo: list[tuple[planner.WarmupTask, Match | None]] = []
            for task in round_:
                got = self._cached_prefix(key_of[task.node], task.node.last)
                if isinstance(got, Entry):
                    pinned.append((got, task.node.last))
                    pinned += [self._derive(key_of[d], d.last, got, None) for d in task.derived]
                else:
                    todo.append((task, got))
            todo.sort(key=lambda t: len(key_of[t[0].node]) - 4 * (t[1].length if t[1] else 0))
            for i in range(0, len(todo), self.batch_size):
                pinned += self._compute(todo[i : i + self.batch_size], key_of, stream)
        return pinned

    def _derive(self, key: bytes, last: int, source: Entry, logits: mx.array | None) -> tuple[Entry, int]:
        """The entry for prefix `key` of `source` (an existing entry if there is one), pinned until `last`."""
        entry = self.cache.get(key)
        if entry is not None:
            entry.needed_until = max(entry.needed_until, last)
            self.cache.pin(entry)
            return entry, last
        caches = kv.view(source.value, source.tokens, len(key) // 4)
        return self.cache.add(key, caches, kv.nbytes(caches), needed_until=last, logits=logits, pin=True), last

    def _cached_prefix(self, key: bytes, last: int) -> Entry | Match | None:
        """The entry holding exactly `key` (an Entry, pinned), else the best base to extend (a Match, or None)."""
        entry = self.cache.get(key)
        if entry is not None:
            entry.needed_until = max(entry.needed_until, last)
            self.cache.pin(entry)
            return entry
        depth = len(key) // 4
        base = self.cache.lookup(key, limit=depth, count=False)
        if self.disk is not None:
            found = self.disk.best_prefix(key, trimmable=self.trimmable, min_tokens=self.min_tokens)
            if found is not None and (base is None or min(found[1], depth) > base.length):
                loaded = self.disk.load(found[0])
                if loaded is not None:
                    self.stats.disk_hits += 1
                    disk_entry = self.cache.add(found[0], loaded, kv.nbytes(loaded), needed_until=last)
                    base = Match(disk_entry, min(found[1], depth))
        if base is not None and base.length == depth:
            if base.entry.tokens == depth:
                base.entry.needed_until = max(base.entry.needed_until, last)
                self.cache.pin(base.entry)
                return base.entry
            # A longer entry holds this prefix: keep its first `depth` tokens as an entry of their own.
            caches = kv.extendable(base.entry.value, base.entry.tokens, depth)
            return self.cache.add(key, caches, kv.nbytes(caches), needed_until=last, pin=True)
        return base

    def _compute(
        self,
        todo: list[tuple[planner.WarmupTask, Match | None]],
        key_of: dict[planner.WarmUp, bytes],
        stream: Any,
    ) -> list[tuple[Entry, int]]:
        if not todo:
            return []
        tic = time.perf_counter()
        starts = [b.length if b else 0 for _, b in todo]
        bases = [kv.extendable(b.entry.value, b.entry.tokens, b.length) if b else None for _, b in todo]
        suffixes = [planner.key_tokens(key_of[t.node])[s:] for (t, _), s in zip(todo, starts, strict=True)]
        # Logits after the node and after each folded ancestor: a request whose whole prompt ends there
        # samples its first token from them instead of recomputing its last prompt token.
        want = [
            {len(suffix) - 1} | {d.depth - 1 - s for d in t.derived if d.depth > s}
            for (t, _), s, suffix in zip(todo, starts, suffixes, strict=True)
        ]
        with mx.stream(stream):
            computed = kv.prefill(self.model, bases, suffixes, self.step, want)
        pinned = []
        for (task, base), s, suffix, (caches, logits) in zip(todo, starts, suffixes, computed, strict=True):
            key = key_of[task.node]
            entry = self.cache.add(
                key, caches, kv.nbytes(caches), needed_until=task.node.last, logits=logits[len(suffix) - 1], pin=True
            )
            pinned.append((entry, task.node.last))
            for d in task.derived:
                source = entry if d.depth > s or base is None else base.entry
                pinned.append(self._derive(key_of[d], d.last, source, logits.get(d.depth - 1 - s)))
            self.stats.warmups += 1 + len(task.derived)
            self.stats.tokens += len(suffix)
            if self.disk is not None:
                self.disk.save(key, caches)
        self.stats.seconds += time.perf_counter() - tic
        return pinned
