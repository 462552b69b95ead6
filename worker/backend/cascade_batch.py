"""Cascade decode batches: rows reference their cached prefix instead of holding a copy of it (issue 14).

A row admitted from a prefix-cache match holds only its own tokens (the uncached suffix, then what it generates)
in the batch cache, and references the prefix as a chain of levels: views of the cached entries along its trie
path, so that a system prompt shared by several documents is one level read once for the rows of every
document, and each document one more level for its own rows (cascade_cache.py holds the levels, cascade.py
attends to them). Admission then copies nothing, suffix prefill and every decode step read each level once for
all its rows, and the batch holds one copy of it.

Each entry a row references is pinned (lifetimes.py, through the prefix cache) from the row's insertion until
it finishes or is removed, so the cache never evicts what a row still reads and its byte count stays honest.

Levels shorter than Switches.min_level_tokens (32) are not worth an attention call each per layer and step:
such a cut is skipped (the next level starts earlier), and a short tail after the last level is copied into the
row's own tokens instead (a few positions, exact). Then the cost model (attention/cascade_cost.py, with the
device's costs measured at start-up, attention/calibrate.py) decides, from the rows that would share each level,
its length and the batch size, how many of the row's levels it references: the rest is copied into the row's
own tokens as the tail is (exact too), so a batch of short levels shared by few rows decodes as cascade off does.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from mlx_lm.models.cache import KVCache

from omlx_jobs import defaults
from omlx_jobs.worker.attention import calibrate
from omlx_jobs.worker.attention.cascade_cost import DeviceCosts, LevelUse, referenced_levels
from omlx_jobs.worker.backend.cascade_cache import SharedPrefixes, row_caches
from omlx_jobs.worker.backend.decode import BatchOwner, DecodeBatch
from omlx_jobs.worker.backend.rows import RowOutput, RowSpec, Timings
from omlx_jobs.worker.cache.lifetimes import Hold
from omlx_jobs.worker.cache.prefix_cache import Entry, Match, PrefixCache


class PrefixLevels:
    """The prefix levels a batch's rows reference, one object per (entry, token range), and the pins behind them."""

    def __init__(
        self,
        cache: PrefixCache,
        layers: int,
        min_level: int = defaults.CASCADE_MIN_LEVEL_TOKENS,
        costs: Callable[[Match], DeviceCosts] | None = None,
        batch: int = 1,
    ) -> None:
        self.cache, self.layers, self.min_level = cache, layers, min_level
        self.costs, self.batch = costs, batch
        """The device's costs for a row's levels (None: reference every level), and the batch size they assume."""
        self._levels = SharedPrefixes()
        self._users: Counter[bytes] = Counter()  # rows referencing levels cut from each entry
        self._rows: Counter[bytes] = Counter()  # rows whose path cuts a level from each entry (referenced or copied)
        self._references: set[int] = set()  # ids of the holds behind references (the others pin copied levels)

    def path(self, match: Match) -> tuple[list[tuple[Entry, int]], int]:
        """The (entry, end) of each level for a row reusing `match`, shallowest first, and where the levels end
        (the rest, up to match.length, is a tail the row holds itself: short, or levels the cost model copies).

        The cost model sees each level's sharers as the batch's rows that continue it (referencing or holding a
        copy) plus this one, and a level some row references as live."""
        cuts, start = self.cuts(match)
        if self.costs is None or not cuts:
            return cuts, start
        uses, begin = [], 0
        for e, end in cuts:
            uses.append(LevelUse(end - begin, self._rows[e.key] + 1, live=self._users[e.key] > 0))
            begin = end
        keep = referenced_levels(uses, self.batch, self.costs(match))
        return cuts[:keep], cuts[keep - 1][1] if keep else 0

    def cuts(self, match: Match) -> tuple[list[tuple[Entry, int]], int]:
        """The levels `path` starts from: every cached entry along the trie path at least min_level deeper than
        the previous cut (and the last, unless the tail after the previous is short)."""
        entry, length = match.entry, match.length
        cuts, start = [], 0
        for ancestor in self.cache.prefixes_of(entry.key, length):
            if ancestor.tokens - start >= self.min_level:
                cuts.append((ancestor, ancestor.tokens))
                start = ancestor.tokens
        if length - start >= self.min_level or not cuts:
            cuts.append((entry, length))
            start = length
        return cuts, start

    def acquire(self, match: Match | None) -> tuple[list[Any], list[Hold[Entry]]]:
        """Per-layer caches for a new row starting from `match` (None: from nothing), and the holds it takes: one
        per level it references, and one per level the cost model copied (counted as a sharer while it stays)."""
        if match is None:
            return row_caches([], self.layers), []
        everything = self.cuts(match)[0] if self.costs is not None else []
        cuts, end = self.path(match)
        chain = self._levels.chain([(e.key, e.value, depth) for e, depth in cuts])
        tail = None
        if end < match.length:
            tail = [_slice(c, end, match.length) for c in match.entry.value]
        holds = []
        for e, _ in cuts:
            holds.append(self.cache.hold(e, None))
            self._references.add(id(holds[-1]))
            self._users[e.key] += 1
        for e, _ in everything[len(cuts) :]:
            holds.append(self.cache.hold(e, None))
        for e, _ in everything:
            self._rows[e.key] += 1
        return row_caches(chain, self.layers, tail), holds

    def release(self, holds: Sequence[Hold[Entry]]) -> None:
        """A row left the batch: unpin its entries, and forget levels no row references any more."""
        for hold in holds:
            self.cache.lifetimes.release(hold)
            key = hold.entry.key
            if self.costs is not None:
                self._rows[key] -= 1
                if self._rows[key] <= 0:
                    del self._rows[key]
            if id(hold) not in self._references:
                continue
            self._references.discard(id(hold))
            self._users[key] -= 1
            if self._users[key] <= 0:
                del self._users[key]
                self._levels.discard(key)
        if holds:
            self.cache.evict_to_fit()


def _slice(c: KVCache, start: int, end: int) -> KVCache:
    out = KVCache()
    out.keys, out.values = c.keys[..., start:end, :], c.values[..., start:end, :]
    out.offset = end - start
    return out


class CascadeBatch(DecodeBatch):
    """A DecodeBatch whose rows reference their cached prefixes (every row has a cascade cache, some an empty
    chain: mlx-lm merges the caches of a batch by the first row's type)."""

    def __init__(
        self,
        backend: BatchOwner,
        cache: PrefixCache,
        min_level: int = defaults.CASCADE_MIN_LEVEL_TOKENS,
        costs: DeviceCosts | bool | None = True,
    ) -> None:
        """costs: the device's costs for the cost model, True to measure them (calibrate.py), None or False to
        reference every level."""
        super().__init__(backend)
        layers = len(backend.model.layers)
        chooser = None
        if isinstance(costs, DeviceCosts):
            chooser = lambda match: costs  # noqa: E731
        elif costs:
            chooser = self._measured
        self.levels = PrefixLevels(cache, layers, min_level, chooser, backend.batch_size)
        self._holds: dict[int, list[Hold[Entry]]] = {}
        self._taken: list[list[Hold[Entry]]] = []

    def _measured(self, match: Match) -> DeviceCosts:
        keys = match.entry.value[0].keys
        model = self.backend.model
        return calibrate.device_costs(
            self.backend.routing.cascade,
            heads=model.layers[0].self_attn.n_heads,
            kv_heads=keys.shape[1],
            dim=keys.shape[3],
            dtype=keys.dtype,
            batch=self.backend.batch_size,
            layers=len(model.layers),
        )

    def insert(self, rows: Sequence[RowSpec]) -> list[int]:
        self._taken = []
        uids = super().insert(rows)
        self._holds.update(zip(uids, self._taken, strict=True))
        return uids

    def _row_caches(self, row: RowSpec) -> list[Any]:
        caches, holds = self.levels.acquire(row.prefix)
        self._taken.append(holds)
        return caches

    def step(self) -> list[RowOutput]:
        outputs = super().step()
        for out in outputs:
            if out.finish is not None:
                self._release([out.row])
        return outputs

    def remove(self, rows: Sequence[int]) -> None:
        super().remove(rows)
        self._release(rows)

    def close(self) -> Timings:
        try:
            self._release(list(self._holds))
        finally:
            timings = super().close()
        return timings

    def _release(self, rows: Sequence[int]) -> None:
        for row in rows:
            holds = self._holds.pop(row, None)
            if holds:
                self.levels.release(holds)
