"""A batch KV cache whose rows hold only their own suffix and reference shared prefix levels stored once.

Layout, per layer:
- `own`: mlx-lm's BatchKVCache, holding each row's own tokens (left-padded, exactly as mlx-lm keeps whole
  prompts today): update_and_fetch, the mask, prepare/finalize (right-padded prefill), filter and extend are
  its own.
- `chains`: per row, the tuple of shared `Segment`s it continues, in position order (a system prompt, then a
  document). A Segment is one layer of a `SharedPrefix`: the keys and values of tokens [start, end) of a cached
  prefix, [1, kv_heads, end - start, D], a view of the prefix-cache entry (no copy). Rows share a segment by
  referencing the same object, so the batch holds one copy of it however many rows continue it.

RoPE: `offset` is each row's prefix length plus its own offset, so a row's own tokens get the positions they
would have if the row held its whole prompt, and nothing else changes for the model.

The model's attention recognises the cache by `cascade_layout()` (see attention/routing.py): it gets the batch's
levels (each distinct segment with the rows that continue it) and the own-suffix cache, and merges the parts
exactly with their log-sum-exp (cascade.attention).

BatchGenerator works with it unchanged: `CascadeKVCache.merge` (classmethod) turns the per-row caches given to
`insert(caches=)` into a batch cache, and filter/extend/extract/prepare/finalize/make_mask/state/nbytes are the
methods its PromptProcessingBatch and GenerationBatch call. Every row of one BatchGenerator must use this class
(a row without shared prefix has an empty chain): mlx-lm merges and extends caches of the first row's type.

Use, for a model where attention/routing.cascade_eligible() holds, with routing.install done; per row,
`row_caches(levels.chain(path), layers)` as its `caches` (path: the cached entries along its trie path, see
SharedPrefixes.chain), its uncached tokens as its prompt. The batch references an entry's arrays as long as a
row that continues it is in the BatchGenerator; pin the entry once per such row, unpin when the row finishes or
is removed, so the prefix cache's byte count matches what is held (cascade_batch.PrefixLevels does).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache, _BaseCache

from omlx_jobs.worker.attention import packed as packing
from omlx_jobs.worker.attention.parts import Level

OWN_STEP = 64
"""Positions the own-suffix cache grows by (mlx-lm's BatchKVCache: 256). Own suffixes are short (a question and
its answer), and with 64 rows of SmolLM2 in float32 each 256 positions cost 750 MB."""


@dataclass(eq=False)
class Segment:
    """Tokens [start, start + length) of a shared prefix in one layer: keys and values [1, kv_heads, length, D]."""

    keys: mx.array
    values: mx.array
    start: int

    @property
    def length(self) -> int:
        return int(self.keys.shape[2])

    @property
    def nbytes(self) -> int:
        return int(self.keys.nbytes + self.values.nbytes)


@dataclass(eq=False)
class SharedPrefix:
    """One prefix level for every layer, stored once and referenced by every row that continues it."""

    segments: list[Segment]
    start: int
    end: int

    @classmethod
    def from_caches(cls, caches: Sequence[Any], start: int, end: int) -> SharedPrefix:
        """Tokens [start, end) of a prefix-cache entry's per-layer KVCaches, as views (nothing is copied)."""
        if not 0 <= start < end:
            raise ValueError(f"a prefix level needs 0 <= start < end, got [{start}, {end})")
        segments = []
        for i, c in enumerate(caches):
            if type(c) is not KVCache or c.offset < end:
                raise ValueError(f"layer {i}: a prefix level needs a KVCache holding at least {end} tokens")
            segments.append(Segment(c.keys[..., start:end, :], c.values[..., start:end, :], start))
        return cls(segments, start, end)

    @property
    def length(self) -> int:
        return self.end - self.start

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.segments)


class SharedPrefixes:
    """The prefix levels in use, one SharedPrefix per (entry, token range): rows that continue the same range get
    the same object, so a batch holds and reads it once. Discard an entry's levels when the entry is released."""

    def __init__(self) -> None:
        self._levels: dict[tuple[bytes, int, int], SharedPrefix] = {}

    def __len__(self) -> int:
        return len(self._levels)

    def chain(self, path: Sequence[tuple[bytes, Sequence[Any], int]]) -> list[SharedPrefix]:
        """The levels of a row whose cached prefix is the path's last entry.

        path: (entry key, entry's per-layer KVCaches, depth in tokens) of the cached entries along the row's trie
        path, shallowest first (e.g. the system prompt's, then the document's). Level i covers tokens
        [depth of entry i-1, depth of entry i) of entry i: each level stores only what its parent does not.
        """
        out: list[SharedPrefix] = []
        start = 0
        for key, caches, depth in path:
            if depth <= start:
                raise ValueError(f"prefix entries along a path must deepen: {depth} tokens after {start}")
            level = self._levels.get((key, start, depth))
            if level is None:
                level = self._levels[(key, start, depth)] = SharedPrefix.from_caches(caches, start, depth)
            out.append(level)
            start = depth
        return out

    def discard(self, key: bytes) -> None:
        """Forget the levels cut from entry `key` (rows that hold them keep them until they leave the batch)."""
        for k in [k for k in self._levels if k[0] == key]:
            del self._levels[k]


def row_caches(chain: Sequence[SharedPrefix], layers: int, own: Sequence[Any] | None = None) -> list[CascadeKVCache]:
    """Per-layer caches of one new row that continues `chain` (levels in position order), for BatchGenerator.insert.

    own: the row's own tokens after the chain, per layer (KVCache), if any; default none (all of the row's
    uncached tokens are then its prompt). The caches are consumed by the insert: do not reuse them.
    """
    position = 0
    for level in chain:
        if level.start != position or len(level.segments) != layers:
            raise ValueError(f"prefix levels must be contiguous from 0 and cover {layers} layers")
        position = level.end
    out = []
    for i in range(layers):
        row = _own([0])
        if own is not None and own[i].offset:
            row = BatchKVCache.merge([own[i]])
            row.step = OWN_STEP
        out.append(CascadeKVCache([tuple(level.segments[i] for level in chain)], row))
    return out


def _own(left_padding: list[int]) -> BatchKVCache:
    own = BatchKVCache(left_padding)
    own.step = OWN_STEP
    return own


def _empty_own() -> BatchKVCache:
    own = _own([])
    own.left_padding = mx.array([], dtype=mx.int32)
    own.offset = mx.array([], dtype=mx.int32)
    return own


_last_filter: list[Any] = [None, 0]
"""The key (keep list, batch size, own length) of the last CascadeKVCache.filter and the padding it dropped."""


def _same_filter(a: tuple[Any, int, int], b: tuple[Any, int, int]) -> bool:
    return a[0] is b[0] and a[1:] == b[1:]


def own_length(cache: BatchKVCache) -> int:
    """The positions a BatchKVCache holds (its rows end there, left-padded)."""
    return int(cache._idx)


def filter_own(cache: BatchKVCache, keep: list[int], shift: int | None) -> int:
    """BatchKVCache.filter (mlx-lm 0.32.2) with the left padding to drop given, or read from the device when None
    (what mlx-lm does for every layer); returns it. For the own-suffix caches here."""
    if cache.keys is not None:
        cache.keys, cache.values = cache.keys[keep], cache.values[keep]
    cache.offset = cache.offset[keep]
    cache.left_padding = cache.left_padding[keep]
    if shift is None:
        shift = min(cache.left_padding.tolist())
    if shift > 0:
        if cache.keys is not None:
            cache.keys, cache.values = cache.keys[..., shift:, :], cache.values[..., shift:, :]
        cache._idx -= shift
        cache.left_padding -= shift
    return shift


class CascadeKVCache(_BaseCache):  # type: ignore[misc]
    """One layer's cache for a batch of rows that continue shared prefix levels and hold only their own suffix."""

    def __init__(self, chains: list[tuple[Segment, ...]], own: BatchKVCache) -> None:
        self.chains = chains
        self.own = own
        self._packed_kv: tuple[tuple[mx.array, ...], mx.array, mx.array] | None = None
        self._invalidate()

    def _invalidate(self) -> None:
        self._layout: tuple[tuple[Level, ...], mx.array] | None = None
        self._packed: packing.Packed | None = None
        self._offset_of: Any = None
        self._offset: Any = None

    # ---- what the model's attention reads ---------------------------------------------------------

    def cascade_layout(self) -> tuple[tuple[Level, ...], BatchKVCache]:
        """The batch's levels (each distinct segment and the rows that continue it) and the own-suffix cache."""
        return self._levels()[0], self.own

    def cascade_packed(self) -> packing.Packed | None:
        """The batch's levels packed for one call (attention/packed.py), None without levels. Built once per
        layout; the packed keys are kept while the batch's set of levels stays the same (rows come and go)."""
        levels = self._levels()[0]
        if not levels:
            return None
        if self._packed is None:
            order = sorted(levels, key=lambda lv: id(lv.keys))
            arrays = tuple(lv.keys for lv in order)
            held = self._packed_kv
            if (
                held is None
                or len(held[0]) != len(arrays)
                or any(a is not b for a, b in zip(held[0], arrays, strict=True))
            ):
                held = self._packed_kv = (arrays, *packing.pack_kv(order))
            self._packed = packing.pack(order, len(self.chains), (held[1], held[2]))
        return self._packed

    def _levels(self) -> tuple[tuple[Level, ...], mx.array]:
        if self._layout is None:
            rows_of: dict[int, tuple[Segment, list[int]]] = {}
            for row, chain in enumerate(self.chains):
                for seg in chain:
                    rows_of.setdefault(id(seg), (seg, []))[1].append(row)
            batch = len(self.chains)
            levels = []
            for seg, rows in rows_of.values():
                if len(rows) == batch:
                    levels.append(Level(seg.keys, seg.values, None, None))
                    continue
                slot, member = [0] * batch, [False] * batch
                for i, row in enumerate(rows):
                    slot[row], member[row] = i, True
                levels.append(
                    Level(seg.keys, seg.values, mx.array(rows, mx.int32), mx.array(slot, mx.int32), mx.array(member))
                )
            lengths = mx.array([sum(s.length for s in chain) for chain in self.chains], mx.int32)
            self._layout = (tuple(levels), lengths)
        return self._layout

    @property
    def offset(self) -> mx.array:
        """Each row's position: its prefix levels' length plus its own tokens (RoPE as if it held the whole prompt)."""
        if self._offset_of is not self.own.offset:
            self._offset = self.own.offset + self._levels()[1]
            self._offset_of = self.own.offset
        return self._offset

    @property
    def left_padding(self) -> mx.array:
        return self.own.left_padding

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append the new tokens to the rows' own suffixes; returns the own keys and values (the levels are apart)."""
        return self.own.update_and_fetch(keys, values)

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None, **kwargs: Any) -> Any:
        """The mask of the own suffixes (causal, left padding): the prefix levels are visible to every query."""
        if window_size is not None:
            raise ValueError("cascade caches have no sliding window; models with one keep today's path")
        return self.own.make_mask(N)

    # ---- what BatchGenerator calls -----------------------------------------------------------------

    def prepare(self, **kwargs: Any) -> None:
        self.own.prepare(**kwargs)

    def finalize(self) -> None:
        self.own.finalize()

    @property
    def state(self) -> Any:
        return self.own.state

    def filter(self, batch_indices: Sequence[int]) -> None:
        """Keep the given rows (in place), as mlx-lm's BatchKVCache.filter, reading the padding to drop once per
        filter of the batch instead of once per layer.

        mlx-lm filters every layer's cache with the same `keep` list, one layer after another, and reads the
        smallest left padding back from the device each time (a sync: 36 per filter on Qwen3-8B, 0.8 s of a
        6.4 s job on an H200). The layers' own caches have equal padding (each sees the same prepare, finalize,
        extend and filter), so the value read for one layer serves the next layers of the same call: same list
        object, same batch size, same own length.
        """
        keep = batch_indices.tolist() if isinstance(batch_indices, mx.array) else list(batch_indices)
        own = self.own
        key = (batch_indices, int(own.left_padding.shape[0]), own_length(own))
        shift = _last_filter[1] if _last_filter[0] is not None and _same_filter(_last_filter[0], key) else None
        _last_filter[:] = [key, filter_own(own, keep, shift)]
        self.chains = [self.chains[i] for i in keep]
        self._invalidate()

    def extend(self, other: CascadeKVCache) -> None:
        """Append the rows of `other` (in place)."""
        if not isinstance(other, CascadeKVCache):
            raise TypeError("a cascade batch extends only with cascade caches: give every row a CascadeKVCache")
        self.own.extend(other.own)
        self.chains = self.chains + other.chains
        self._invalidate()

    @classmethod
    def merge(cls, caches: Sequence[CascadeKVCache]) -> CascadeKVCache:
        """One batch cache from per-row (or per-batch) caches, rows in order. Segments are shared, not copied."""
        out = cls([], _empty_own())
        for c in caches:
            out.extend(c)
        return out

    def extract(self, idx: int) -> CascadeKVCache:
        """Row `idx` alone: its chain (shared) and a copy of its own tokens."""
        own = _own([0])
        if self.own.keys is not None:
            own = BatchKVCache.merge([self.own.extract(idx)])
            own.step = OWN_STEP
        return CascadeKVCache([self.chains[idx]], own)

    def to_kv_cache(self) -> KVCache:
        """A one-row cache as mlx-lm's KVCache holding the whole prompt (its levels then its own tokens): a copy."""
        if len(self.chains) != 1:
            raise ValueError("to_kv_cache needs a one-row cache; extract the row first")
        own = self.own.extract(0) if self.own.keys is not None else KVCache()
        parts = [(s.keys, s.values) for s in self.chains[0]]
        if own.keys is not None:
            parts.append((own.keys[..., : own.offset, :], own.values[..., : own.offset, :]))
        out = KVCache()
        if parts:
            out.keys = mx.concatenate([k for k, _ in parts], axis=2)
            out.values = mx.concatenate([v for _, v in parts], axis=2)
            out.offset = int(out.keys.shape[2])
        return out

    def __deepcopy__(self, memo: dict[int, Any]) -> CascadeKVCache:
        # PromptProcessingBatch.split deep-copies its caches: the levels are shared, never copied.
        out = CascadeKVCache(list(self.chains), copy.deepcopy(self.own, memo))
        out._packed_kv = self._packed_kv
        return out

    def size(self) -> int:
        return self.own.size()

    def empty(self) -> bool:
        return self.own.empty() and not any(self.chains)

    @property
    def nbytes(self) -> int:
        """The own suffixes plus each distinct segment once."""
        distinct = {id(s): s for chain in self.chains for s in chain}
        return int(self.own.nbytes + sum(s.nbytes for s in distinct.values()))
