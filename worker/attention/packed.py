"""All the prefix levels of a decode step in one attention call per layer, however many groups and levels.

The batch's distinct levels are packed once per layout (rows joining or leaving, levels appearing) into one key
buffer [1, kv_heads, T, D] (T: their lengths summed), with a mask [B, T] of the keys each row continues. A decode
step then folds every row's queries into one query axis ([1, kv_heads, B * G, D]), attends to the packed keys once
(each level's keys read once for all its rows), masked per row: the softmax over the union of a row's levels is
exactly the merge of its levels' parts, so its (o, lse) merge with the row's own suffix as before (parts.py, or the
CUDA suffix kernel). The price is compute over every (row, level) pair, the mask's zeros included: the cost model
(cascade_cost.py), calibrated on this path, copies the levels for which that does not pay.

The rows are padded to a few bucket sizes (ROW_BUCKETS) so that the compiled graph is built once per bucket, not
for every batch size as rows come and go (mlx 0.32.4's shapeless compile keeps an unflatten's shape from its first
call, so the row count is part of the key). Padded rows see no key (lse -inf, o 0) and are cut off after.
Portable mx ops: the CPU, Metal and CUDA run the same graph.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import mlx.core as mx

from omlx_jobs.worker.attention.options import CascadeOptions, Graphs
from omlx_jobs.worker.attention.parts import Level, softmax_v

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256)
"""Row counts a packed decode step is compiled for (larger batches round up to a multiple of 64)."""


def bucket(rows: int) -> int:
    """The bucket size `rows` rows are padded to."""
    for size in ROW_BUCKETS:
        if rows <= size:
            return size
    return -(-rows // 64) * 64


@dataclass(eq=False)
class Packed:
    """One layer's prefix levels of a decode batch in one buffer, and which keys each row sees."""

    keys: mx.array
    """[1, kv_heads, T, D]: the levels' keys one after the other."""
    values: mx.array
    visible: mx.array
    """[B, T] bool: row b continues the level key t belongs to."""
    _masks: dict[tuple[int, int], mx.array] = field(default_factory=dict, repr=False)

    def mask(self, g: int, rows: int) -> mx.array:
        """visible padded to `rows` rows (False), each row repeated for its g query heads: [1, 1, rows * g, T]."""
        key = (g, rows)
        if key not in self._masks:
            b, t = self.visible.shape
            v = self.visible if rows == b else mx.concatenate([self.visible, mx.zeros((rows - b, t), mx.bool_)])
            self._masks[key] = mx.repeat(v, g, axis=0)[None, None]
        return self._masks[key]


def pack_kv(levels: Sequence[Level]) -> tuple[mx.array, mx.array]:
    """The levels' keys and values concatenated along the positions (no copy for a single level)."""
    if len(levels) == 1:
        return levels[0].keys, levels[0].values
    return mx.concatenate([lv.keys for lv in levels], axis=2), mx.concatenate([lv.values for lv in levels], axis=2)


def visibility(levels: Sequence[Level], batch: int) -> mx.array:
    """[B, T] bool: each row sees the keys of the levels it continues (a level without rows: every row)."""
    parts = []
    for lv in levels:
        member = lv.member if lv.rows is not None else mx.ones((batch,), mx.bool_)
        parts.append(mx.broadcast_to(member[:, None], (batch, lv.keys.shape[2])))
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=1)


def pack(levels: Sequence[Level], batch: int, kv: tuple[mx.array, mx.array] | None = None) -> Packed:
    """The levels packed for `batch` rows; `kv`: their keys and values already packed (pack_kv)."""
    keys, values = kv if kv is not None else pack_kv(levels)
    return Packed(keys, values, visibility(levels, batch))


def decode(q: mx.array, packed: Packed, scale: float, options: CascadeOptions) -> tuple[mx.array, mx.array]:
    """The levels' (o [B, H, 1, D] float32, lse [B, H, 1]) for one query per row, in one masked call."""
    b, h, _, d = q.shape
    kv_heads = packed.keys.shape[1]
    g = h // kv_heads
    rows = bucket(b)
    if rows > b:
        q = mx.concatenate([q, mx.zeros((rows - b, h, 1, d), q.dtype)])
    compiled = options.compiling
    base2 = not compiled and mx.default_device() == mx.cpu
    key = ("packed", kv_heads, g, rows, scale, compiled, base2)
    step = Graphs.get(options.graphs.decode_steps, key, functools.partial(_graph, kv_heads, g, scale, base2), compiled)
    o, lse = step(q, packed.keys, packed.values, packed.mask(g, rows))
    return (o[:b], lse[:b]) if rows > b else (o, lse)


def _graph(kv_heads: int, g: int, scale: float, base2: bool) -> Callable[..., tuple[mx.array, mx.array]]:
    """step(q [R, H, 1, D], keys, values, mask [1, 1, R * g, T]) -> (o [R, H, 1, D] float32, lse [R, H, 1])."""

    def step(q: mx.array, keys: mx.array, values: mx.array, mask: mx.array) -> tuple[mx.array, mx.array]:
        folded = mx.flatten(mx.unflatten(q, 1, (kv_heads, g)), 2, 3)  # [R, kv_heads, g, D]
        rows_q = mx.expand_dims(mx.flatten(folded.transpose(1, 0, 2, 3), 1, 2), 0)  # [1, kv_heads, R * g, D]
        o, lse = softmax_v(rows_q, keys, values, mask, scale, base2)
        o = mx.unflatten(mx.squeeze(o, 0), 1, (-1, g)).transpose(1, 0, 2, 3)
        lse = mx.unflatten(mx.squeeze(lse, 0), 1, (-1, g)).transpose(1, 0, 2)
        return mx.expand_dims(mx.flatten(o, 1, 2), 2), mx.expand_dims(mx.flatten(lse, 1, 2), 2)

    return step
