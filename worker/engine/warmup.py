"""Warm-ups: prefill each shared prefix once and keep it in the prefix cache (memory, and disk if set).

The scheduler says which prefixes a window of upcoming requests shares and until which position each is
needed; this computes the missing ones in batched passes (planner.warmup_rounds, run by the backend) and holds
every entry it makes or finds until its group has been admitted (lifetimes.py releases it then).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from omlx_jobs.worker.backend.model import ModelBackend
from omlx_jobs.worker.cache import kv
from omlx_jobs.worker.cache.disk import DiskCache
from omlx_jobs.worker.cache.prefix_cache import Entry, Match, PrefixCache
from omlx_jobs.worker.engine import planner
from omlx_jobs.worker.engine.charges import Charges
from omlx_jobs.worker.engine.scheduler import Warmup


@dataclass
class WarmupStats:
    warmups: int = 0
    tokens: int = 0
    """Prompt tokens computed by warm-ups."""
    seconds: float = 0.0
    disk_hits: int = 0


class WarmUps:
    def __init__(
        self, backend: ModelBackend, cache: PrefixCache, disk: DiskCache | None, *, batch_size: int, min_tokens: int
    ) -> None:
        self.backend, self.cache, self.disk = backend, cache, disk
        self.trimmable, self.batch_size, self.min_tokens = backend.trimmable, batch_size, min_tokens
        self.stats = WarmupStats()
        self.charges = Charges()
        self.scorer: Any = None
        """Set per window by the engine when its requests want echo's prompt logprobs (worker/extras/outputs.py):
        warm-ups then also keep each prefix's per-position logprobs, so no request recomputes its prefix."""

    def start_run(self) -> None:
        """A new run: fresh stats, and no computed tokens left to charge."""
        self.stats, self.charges = WarmupStats(), Charges()

    def ensure(self, warmups: list[Warmup]) -> None:
        """Make sure each warm-up's prefix is cached, computing only what no entry (memory or disk) holds.

        Passes run in batches of prefill_batch_size; a chain of nested warm-ups is one pass (see
        planner.warmup_rounds). Every entry is held until its group is admitted (its node's `last`).
        """
        if not warmups:
            return
        by_node = {w.node: w for w in warmups}
        for round_ in planner.warmup_rounds(list(by_node), fold_chains=self.trimmable):
            todo: list[tuple[planner.WarmupTask, Match | None]] = []
            for task in round_:
                got = self._cached_prefix(by_node[task.node])
                if isinstance(got, Entry):
                    for d in task.derived:
                        self._derive(by_node[d], got, None)
                else:
                    todo.append((task, got))
            todo.sort(key=lambda t: t[0].node.depth - (t[1].length if t[1] else 0))
            for i in range(0, len(todo), self.batch_size):
                self._compute(todo[i : i + self.batch_size], by_node)

    def _derive(self, w: Warmup, source: Entry, logits: Any) -> None:
        """The entry for prefix `w` of `source` (an existing entry if there is one), held until `w.node.last`."""
        entry = self.cache.get(w.key)
        if entry is not None:
            self.cache.hold(entry, w.node.last)
            return
        caches = kv.view(source.value, source.tokens, w.node.depth)
        self.cache.add(w.key, caches, kv.nbytes(caches), needed_until=w.node.last, logits=logits, pin=True)

    def _cached_prefix(self, w: Warmup) -> Entry | Match | None:
        """The entry holding exactly `w`'s prefix (an Entry, held), else the best base to extend (a Match, or None)."""
        key, depth, last = w.key, w.node.depth, w.node.last
        entry = self.cache.get(key)
        if entry is not None:
            self.cache.hold(entry, last)
            return entry
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
                self.cache.hold(base.entry, last)
                return base.entry
            # A longer entry holds this prefix: keep its first `depth` tokens as an entry of their own.
            caches = kv.extendable(base.entry.value, base.entry.tokens, depth)
            return self.cache.add(key, caches, kv.nbytes(caches), needed_until=last, pin=True)
        return base

    def _compute(
        self, todo: list[tuple[planner.WarmupTask, Match | None]], by_node: dict[planner.WarmUp, Warmup]
    ) -> None:
        if not todo:
            return
        if self.scorer is not None:
            self._compute_scored(todo, by_node)
            return
        tic = time.perf_counter()
        starts = [b.length if b else 0 for _, b in todo]
        bases = [kv.extendable(b.entry.value, b.entry.tokens, b.length) if b else None for _, b in todo]
        suffixes = [by_node[t.node].prompt.tokens[s : t.node.depth] for (t, _), s in zip(todo, starts, strict=True)]
        # Logits after the node and after each folded ancestor: a request whose whole prompt ends there
        # samples its first token from them instead of recomputing its last prompt token.
        want = [
            {len(suffix) - 1} | {d.depth - 1 - s for d in t.derived if d.depth > s}
            for (t, _), s, suffix in zip(todo, starts, suffixes, strict=True)
        ]
        computed = self.backend.prefill(bases, suffixes, want, [by_node[t.node].prompt for t, _ in todo])
        for (task, base), s, suffix, (caches, logits) in zip(todo, starts, suffixes, computed, strict=True):
            w = by_node[task.node]
            entry = self.cache.add(
                w.key, caches, kv.nbytes(caches), needed_until=task.node.last, logits=logits[len(suffix) - 1], pin=True
            )
            for d in task.derived:
                source = entry if d.depth > s or base is None else base.entry
                self._derive(by_node[d], source, logits.get(d.depth - 1 - s))
            self.stats.warmups += 1 + len(task.derived)
            self.stats.tokens += len(suffix)
            self.charges.computed(w.key, s, task.node.depth)
            if self.disk is not None:
                self.disk.save(w.key, caches)
        self.stats.seconds += time.perf_counter() - tic

    def _compute_scored(
        self, todo: list[tuple[planner.WarmupTask, Match | None]], by_node: dict[planner.WarmUp, Warmup]
    ) -> None:
        """Warm-ups that also keep their prefixes' per-position logprobs (extras/echo.py), in one batched pass."""
        tic = time.perf_counter()
        nodes = [by_node[task.node] for task, _ in todo]
        tasks = [(w.key, w.prompt.tokens[: w.node.depth], base) for w, (_, base) in zip(nodes, todo, strict=True)]
        for w, (task, _), (caches, logits, computed) in zip(nodes, todo, self.scorer.warm(tasks), strict=True):
            entry = self.cache.add(
                w.key, caches, kv.nbytes(caches), needed_until=task.node.last, logits=logits.reshape(1, -1), pin=True
            )
            for d in task.derived:
                self._derive(by_node[d], entry, None)
            self.stats.warmups += 1 + len(task.derived)
            self.stats.tokens += computed
            self.charges.computed(w.key, w.node.depth - computed, w.node.depth)
            if self.disk is not None:
                self.disk.save(w.key, caches)
        self.stats.seconds += time.perf_counter() - tic
