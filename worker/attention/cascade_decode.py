"""A cascade decode step (one query per row): the prefix levels and the rows' own suffixes, merged.

Portable: one mx-ops graph per level structure and batch shape (parts.softmax_v per level, merged by lse),
compiled on GPUs. With the CUDA kernels the options name: the levels in kernels/prefix.py's tensor-core kernel (a
level that every row continues goes to the suffix kernel in its parts; other layouts merge the parts first) and
the rows' own suffixes in kernels/suffix.py's, which merges them with what the levels gave.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx

from omlx_jobs.worker.attention import fused
from omlx_jobs.worker.attention import packed as packing
from omlx_jobs.worker.attention.kernels import prefix as prefix_kernel
from omlx_jobs.worker.attention.kernels import ragged
from omlx_jobs.worker.attention.options import CascadeOptions, Graphs
from omlx_jobs.worker.attention.packed import Packed
from omlx_jobs.worker.attention.parts import NEG_INF, Level, attend, merge, merge_pair, scatter_rows, softmax_v


def decode(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    levels: Sequence[Level],
    scale: float,
    mask: mx.array | None,
    start: mx.array | None,
    buffers: tuple[mx.array, mx.array] | None,
    options: CascadeOptions,
    packed: Packed | None = None,
) -> mx.array:
    """cascade.attention for one query per row (its arguments). With options.packing, the levels in one masked
    call (packed.py); else one graph per level structure and batch shape (compiled on GPUs). With
    options.suffix_kernel the own suffixes are merged in that kernel, and with options.prefix_kernel the levels
    attended in it where it takes the dtype and head size (not packed)."""
    b, h, _, _ = q.shape
    if levels and start is not None and buffers is not None and options.fused_decode:
        return fused.decode(q, *buffers, k.shape[2], start, levels, scale, rows_per_call=options.rows_per_call)
    kernel = options.suffix_kernel
    if not (kernel is not None and levels and start is not None and ragged.supported(h, k.shape[1], q.shape[-1])):
        kernel = None
    prefix = options.prefix_kernel if kernel is not None else None
    if prefix is not None and not prefix_supported(q.dtype, h, k.shape[1], q.shape[-1]):
        prefix = None
    one_level = len(levels) == 1 and levels[0].rows is None
    if levels and options.packing and not (prefix is not None and one_level):  # that one: the prefix kernel's
        o, lse = packing.decode(q, packed if packed is not None else packing.pack(levels, b), scale, options)
        if kernel is not None:
            return kernel(q, k, v, start, o, lse, scale)
        # Not compiled: parts.attend's shapeless compile crashed the CPU on a batch of one (mlx 0.32.4).
        own = attend(q, k, v, scale, mask)
        return merge([own, (o, lse)], compiled=options.compiling)[0].astype(q.dtype)
    if prefix is not None:
        if one_level:  # one level for every row: the kernel merges its parts
            return kernel(q, k, v, start, *prefix(q, levels[0].keys, levels[0].values, None, scale), scale)
        return kernel(q, k, v, start, *_prefix_levels(q, levels, scale, prefix, options), scale)
    structure = tuple(lv.rows is not None for lv in levels)
    sizes = batch_sizes(b, levels)
    step = _decode_step(k.shape[1], h // k.shape[1], scale, structure, kernel is None, sizes, options)
    own = [] if kernel is not None else [k, v, mask if mask is not None else mx.array(True)]
    flat = [x for lv in levels for x in (lv.keys, lv.values, lv.rows, lv.slot, lv.member) if x is not None]
    o, lse = step(q, *own, *flat)
    return o.astype(q.dtype) if kernel is None else kernel(q, k, v, start, o, lse, scale)


def batch_sizes(batch: int, levels: Sequence[Level]) -> tuple[int, ...]:
    """The batch's rows and the rows of each level that has rows: a compiled decode step is for these."""
    return (batch, *(lv.rows.shape[0] for lv in levels if lv.rows is not None))


def _decode_step(
    kv_heads: int,
    g: int,
    scale: float,
    structure: tuple[bool, ...],
    own: bool,
    sizes: tuple[int, ...],
    options: CascadeOptions,
) -> Callable[..., tuple[mx.array, mx.array]]:
    """The decode step's attention for one level structure: one call (and, compiled, a few fused kernels).

    `sizes` (batch_sizes) are part of the key: the graph unflattens its rows out of the query axis, and mlx
    0.32.4's shapeless compile keeps an unflatten's shape from the first call, so a step compiled for one batch
    gave another batch wrong rows. Compiled once per batch shape, it still follows the suffixes as they grow.
    """
    compiled = options.compiling
    base2 = not compiled and mx.default_device() == mx.cpu
    key = (kv_heads, g, scale, structure, own, compiled, base2, sizes if compiled else ())
    build = functools.partial(_decode_graph, kv_heads, g, scale, structure, own, base2)
    return Graphs.get(options.graphs.decode_steps, key, build, compiled)


def _decode_graph(
    kv_heads: int, g: int, scale: float, structure: tuple[bool, ...], own: bool, base2: bool = False
) -> Callable[..., tuple[mx.array, mx.array]]:
    """decode(q, [k, v, mask], *levels) -> (o [B, H, 1, D] float32, lse [B, H, 1]); shapeless but for the rows.

    The G query heads of a kv head are its rows' queries ([B, kv_heads, G, D]); a level folds its rows into them
    ([1, kv_heads, r * G, D]). `own`: also attend the own suffixes (else the kernel does, from o and lse).
    `base2`: exponentiate as the CPU does (see softmax_v).
    """

    def decode(q: mx.array, *arrays: mx.array) -> tuple[mx.array, mx.array]:
        folded = mx.flatten(mx.unflatten(q, 1, (kv_heads, g)), 2, 3)
        acc = softmax_v(folded, *arrays[:3], scale, base2) if own else None
        i = 3 if own else 0
        for has_rows in structure:
            keys, values = arrays[i], arrays[i + 1]
            qs = mx.take(folded, arrays[i + 2], axis=0) if has_rows else folded
            rows_q = mx.expand_dims(mx.flatten(qs.transpose(1, 0, 2, 3), 1, 2), 0)
            o, lse = softmax_v(rows_q, keys, values, None, scale, base2)
            o = mx.unflatten(mx.squeeze(o, 0), 1, (-1, g)).transpose(1, 0, 2, 3)
            lse = mx.unflatten(mx.squeeze(lse, 0), 1, (-1, g)).transpose(1, 0, 2)
            if has_rows:
                o, lse = scatter_rows(o, lse, arrays[i + 3], arrays[i + 4])
            i += 5 if has_rows else 2
            acc = (o, lse) if acc is None else merge_pair(*acc, o, lse)
        assert acc is not None, "a decode step attends to something"
        return mx.expand_dims(mx.flatten(acc[0], 1, 2), 2), mx.expand_dims(mx.flatten(acc[1], 1, 2), 2)

    return decode


def _prefix_levels(
    q: mx.array,
    levels: Sequence[Level],
    scale: float,
    prefix: Callable[..., tuple[mx.array, mx.array]],
    options: CascadeOptions,
) -> tuple[mx.array, mx.array]:
    """The levels' merged (o [B, H, 1, D], lse [B, H, 1]) from `prefix` (prefix_kernel.prefix_decode's contract)."""
    flat, structure = [], []
    for lv in levels:
        o, lse = prefix(q, lv.keys, lv.values, lv.rows, scale)
        flat += [o, lse, *((lv.slot, lv.member) if lv.rows is not None else ())]
        structure.append((lv.rows is not None, o.shape[0] == 1))
    # Keyed on the head count and size too: mlx 0.32.4's shapeless compile keeps a gather's (mx.take's) slice shape.
    compiled = options.compiling
    key = (tuple(structure), q.shape[1], q.shape[3], compiled)
    return Graphs.get(options.graphs.merges, key, lambda: _merge_levels(tuple(structure)), compiled)(*flat)


def _merge_levels(structure: tuple[tuple[bool, bool], ...]) -> Callable[..., tuple[mx.array, mx.array]]:
    """merged(*[o_parts, lse_parts, (slot, member)] per level) -> (o [B, H, 1, D], lse [B, H, 1]): shapeless.

    structure: per level, whether it has rows (a subset of the batch) and whether its keys are in one part (no
    reduction over the parts: mlx 0.32.4's shapeless compile crashes on a reduction over an axis of size 1).
    """

    def merged(*arrays: mx.array) -> tuple[mx.array, mx.array]:
        acc, i = None, 0
        for has_rows, single in structure:
            if single:
                o, lse = mx.squeeze(arrays[i], 0), mx.squeeze(arrays[i + 1], 0)
            else:
                o, lse = _merge_splits(arrays[i], arrays[i + 1])
            o, lse = mx.expand_dims(o, 2), mx.expand_dims(lse, 2)
            if has_rows:
                o, lse = scatter_rows(o, lse, arrays[i + 2], arrays[i + 3])
            i += 4 if has_rows else 2
            acc = (o, lse) if acc is None else merge_pair(*acc, o, lse)
        assert acc is not None, "a decode step's prefix attends to some level"
        return acc

    return merged


def _merge_splits(o: mx.array, lse: mx.array) -> tuple[mx.array, mx.array]:
    """o [S, ..., D], lse [S, ...]: attention over S disjoint parts of the keys, merged into one (o, lse)."""
    m = lse.max(axis=0)
    m = mx.where(m == NEG_INF, 0.0, m)
    w = mx.exp(lse - m)
    total = w.sum(axis=0)
    return (o * w[..., None]).sum(axis=0) / mx.maximum(total, 1e-30)[..., None], m + mx.log(total)


def prefix_supported(dtype: Any, heads: int, kv_heads: int, dim: int) -> bool:
    return prefix_kernel.supported(dtype, heads, kv_heads, dim)
