"""Cascade attention through mlx's fused attention (`mx.fast.scaled_dot_product_attention`), on GPUs.

cascade.py's portable path computes each part (a prefix level, the own suffixes) with mx ops and merges them by
their log-sum-exp. mlx's fused attention returns no log-sum-exp, so here the parts go into one call instead,
exact without a merge:
- prefill (`prefill`): a window whose rows all continue the same levels attends to the levels' keys (broadcast
  to the rows, for this layer only) followed by its own keys;
- decode (`decode`): the rows go along the query axis. A block of `rows_per_call` rows attends, in one call, to
  the levels followed by the block's own suffixes laid end to end, and the mask lets each row see the levels it
  continues and its own suffix only. The levels are read once per block instead of once per row, and on CUDA
  the call is cuDNN's flash attention (tensor cores) where the mx-ops path writes and reads score matrices.

Shapes are kept few, because cuDNN builds a plan per shape: blocks are padded to a multiple of 8 rows, and the
own suffixes are passed in whole OWN_BUCKET-position pieces of their buffer (the unused tail is masked).
The cache holds one copy of each level either way.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from omlx_jobs import defaults
from omlx_jobs.defaults import Mode
from omlx_jobs.worker.attention.options import mode_on
from omlx_jobs.worker.attention.parts import Level

OWN_BUCKET = 64
"""Own-suffix positions are passed in pieces of this many (backend/cascade_cache.OWN_STEP), so shapes change
rarely."""


def use_prefill(levels: Sequence[Level], mode: Mode) -> bool:
    """Whether a prefill chunk goes through `prefill` (Switches.cascade_fused_prefill: "auto" on GPUs): when every
    row continues every level (the rows of one prefix group: what a prefill window holds)."""
    return all(lv.rows is None for lv in levels) and mode_on(mode)


def prefill(
    q: mx.array, k: mx.array, v: mx.array, levels: Sequence[Level], scale: float, mask: mx.array | None
) -> mx.array:
    """A prefill chunk in one call over the levels' keys (broadcast to the rows, for this layer only: freed once
    it is computed) followed by the rows' own keys; the levels are visible to every query."""
    b = q.shape[0]
    keys = [mx.broadcast_to(lv.keys, (b, *lv.keys.shape[1:])) for lv in levels]
    values = [mx.broadcast_to(lv.values, (b, *lv.values.shape[1:])) for lv in levels]
    if mask is not None:
        while mask.ndim < 4:
            mask = mask[None]
        shared = sum(lv.keys.shape[2] for lv in levels)
        mask = mx.concatenate([mx.ones((*mask.shape[:-1], shared), dtype=mx.bool_), mask.astype(mx.bool_)], axis=-1)
    keys_all = mx.concatenate([*keys, k], axis=2)
    values_all = mx.concatenate([*values, v], axis=2)
    return mx.fast.scaled_dot_product_attention(q, keys_all, values_all, scale=scale, mask=mask)


def decode(
    q: mx.array,
    own_keys: mx.array,
    own_values: mx.array,
    length: int,
    start: mx.array,
    levels: Sequence[Level],
    scale: float,
    *,
    rows_per_call: int = defaults.FUSED_ROWS_PER_CALL,
) -> mx.array:
    """One decode step: q [B, H, 1, D] of every row against its levels and its own suffix, in q's dtype.

    own_keys, own_values: the own-suffix buffers [B, kv_heads, >= length, D]; row r's own keys are positions
    start[r] .. length - 1 (left-padded, as mlx-lm's BatchKVCache keeps them). Rows go in blocks of
    `rows_per_call` (Switches.fused_rows_per_call).
    """
    b, h, _, d = q.shape
    kv_heads = own_keys.shape[1]
    rows = min(rows_per_call, -(-b // 8) * 8)
    blocks = -(-b // rows)
    pad = blocks * rows - b
    s = min(own_keys.shape[2], -(-length // OWN_BUCKET) * OWN_BUCKET)

    def padded(x: mx.array, value: int = 0) -> mx.array:
        return mx.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1), constant_values=value) if pad else x

    def own_blocks(x: mx.array) -> mx.array:  # [B, kv, S, D] -> [blocks, kv, rows * s, D]: each block's suffixes
        x = padded(x[:, :, :s]).reshape(blocks, rows, kv_heads, s, d)
        return x.transpose(0, 2, 1, 3, 4).reshape(blocks, kv_heads, rows * s, d)

    queries = padded(q.reshape(b, h, d)).reshape(blocks, rows, h, d).transpose(0, 2, 1, 3)
    keys = [mx.broadcast_to(lv.keys, (blocks, *lv.keys.shape[1:])) for lv in levels] + [own_blocks(own_keys)]
    values = [mx.broadcast_to(lv.values, (blocks, *lv.values.shape[1:])) for lv in levels] + [own_blocks(own_values)]
    mask = mx.concatenate([*_level_masks(levels, b, pad, blocks, rows), _own_mask(start, length, s, pad, rows)], -1)
    out = mx.fast.scaled_dot_product_attention(
        queries, mx.concatenate(keys, axis=2), mx.concatenate(values, axis=2), scale=scale, mask=mask
    )
    return out.transpose(0, 2, 1, 3).reshape(blocks * rows, h, d)[:b, :, None, :]


def _level_masks(levels: Sequence[Level], b: int, pad: int, blocks: int, rows: int) -> list[mx.array]:
    """Per level, [blocks, 1, rows, P]: whether each row continues it (padding rows see every level)."""
    out = []
    for lv in levels:
        member = mx.ones((b,), dtype=mx.bool_) if lv.member is None else lv.member
        if pad:
            member = mx.concatenate([member, mx.ones((pad,), dtype=mx.bool_)])
        out.append(mx.broadcast_to(member.reshape(blocks, 1, rows, 1), (blocks, 1, rows, lv.keys.shape[2])))
    return out


def _own_mask(start: mx.array, length: int, s: int, pad: int, rows: int) -> mx.array:
    """[blocks, 1, rows, rows * s]: row i of a block sees positions start .. length - 1 of its own suffix only."""
    first = mx.concatenate([start, mx.zeros((pad,), dtype=start.dtype)]) if pad else start
    position = mx.arange(s)
    real = (position[None] >= first[:, None]) & (position[None] < length)  # [blocks * rows, s]
    own = mx.eye(rows, dtype=mx.bool_)[None, :, :, None] & real.reshape(-1, rows, 1, s)
    return own.reshape(-1, 1, rows, rows * s)
