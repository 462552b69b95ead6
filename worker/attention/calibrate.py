"""The device costs of cascade decode steps (cascade_cost.DeviceCosts), measured once per device and model shape.

A few timed calls of cascade.attention as the routing runs it, on random keys of the model's shape: one level every
row continues (the base), then its rows' own suffixes longer by P tokens (what a copy costs), then one more level
of half the rows, at two lengths (a referenced level's fixed cost and its cost per token). Each timing is a chain of
calls evaluated once, the best of a few repeats; the whole measure takes well under a second on an H200.

The CPU is not measured (timings on a shared CPU were noise: a level's call measured cheaper than none), but
estimated (cpu_costs): attention there is compute-bound, its own-suffix part is mx ops over every row padded to
the longest (a copy costs every row of the batch), a referenced level's rows are one matmul (taken as 4x as
efficient as the rows' own matrix-vector products), and each level costs a fixed overhead per layer. So a small
model's short levels are copied (on the tiny test model, cascade off measured faster than references), and a
real model's levels shared by several rows, or long, are referenced (SmolLM2: cascade measured faster).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import mlx.core as mx

from omlx_jobs import defaults
from omlx_jobs.worker.attention import cascade
from omlx_jobs.worker.attention import packed as packing
from omlx_jobs.worker.attention.cascade_cost import COPY_BYTES_LIMIT, DeviceCosts
from omlx_jobs.worker.attention.options import CascadeOptions
from omlx_jobs.worker.attention.parts import Level

CALLS = 12
"""Calls per timing (chained: each call's output is the next one's queries)."""
REPEATS = 3

CPU_FLOPS = 50e9
"""Attention arithmetic a CPU core pair does per second, for cpu_costs (float32, mlx 0.32.4)."""
CPU_LEVEL_CALL_S = 150e-6
"""A referenced level's fixed cost per layer and step on the CPU (its graph, gathers and merge)."""


def cpu_costs(heads: int, dim: int, per_token: int = 0) -> DeviceCosts:
    """The CPU's estimated costs (see the module docstring) for a model of `heads` query heads of size `dim`."""
    row_token = 4 * heads * dim / CPU_FLOPS  # scores and weighted values: 2 multiply-adds per head and dimension
    return DeviceCosts(
        level_call_s=CPU_LEVEL_CALL_S,
        level_token_s=0.0,
        copy_token_s=row_token,
        padded=True,
        bytes_per_token=per_token,
        level_row_token_s=row_token / 4,
    )


_measured: dict[tuple[object, ...], DeviceCosts] = {}


def device_costs(
    options: CascadeOptions, *, heads: int, kv_heads: int, dim: int, dtype: mx.Dtype, batch: int, layers: int
) -> DeviceCosts:
    """The costs for this shape under `options`, measured the first time (cached per process); estimated on the
    CPU (cpu_costs)."""
    gpu = mx.default_device() != mx.cpu
    per_token = layers * 2 * kv_heads * dim * dtype.size
    if not gpu:
        return cpu_costs(heads, dim, per_token)
    key = (str(mx.default_device()), heads, kv_heads, dim, dtype, batch, options.suffix_kernel is not None, gpu)
    if key not in _measured:
        _measured[key] = measure(options, heads=heads, kv_heads=kv_heads, dim=dim, dtype=dtype, batch=batch)
        info = mx.device_info()
        memory = int(info.get("memory_size") or info.get("total_memory") or 0)
        limit = max(COPY_BYTES_LIMIT, memory // 4)
        _measured[key] = dataclasses.replace(
            _measured[key],
            bytes_per_token=per_token,
            copy_limit=limit,
            min_tokens=defaults.CASCADE_GPU_MIN_REFERENCE_TOKENS,
        )
    return _measured[key]


def measure(
    options: CascadeOptions, *, heads: int, kv_heads: int, dim: int, dtype: mx.Dtype, batch: int
) -> DeviceCosts:
    """Time cascade.attention (one layer's decode step) for the four layouts in the module docstring."""
    gpu = mx.default_device() != mx.cpu
    p = 512 if gpu else 128
    base, own = 64, 32
    mx.random.seed(0)

    def keys(rows: int, n: int) -> mx.array:
        return mx.random.normal((rows, kv_heads, n, dim)).astype(dtype)

    q = mx.random.normal((batch, heads, 1, dim)).astype(dtype)
    full = Level(keys(1, base), keys(1, base), None, None)
    half = max(1, batch // 2)
    slot = mx.array([min(i, half - 1) for i in range(batch)], mx.int32)
    member = mx.arange(batch) < half
    rows = mx.arange(half, dtype=mx.int32)

    def subset(n: int) -> Level:
        return Level(keys(1, n), keys(1, n), rows, slot, member)

    def timing(levels: list[Level], n: int) -> float:
        k, v = keys(batch, n), keys(batch, n)
        start = mx.zeros((batch,), mx.int32)
        mask = mx.ones((batch, 1, 1, n), mx.bool_)
        mx.eval(k, v, *[x for lv in levels for x in (lv.keys, lv.values)])
        buffers = (k, v)
        packed = packing.pack(levels, batch) if options.packing else None  # as the batch cache holds it

        def run(x: mx.array) -> mx.array:
            return cascade.attention(x, k, v, levels, dim**-0.5, mask, start, buffers, options, packed=packed)

        return _best(run, q)

    t_base = timing([full], own)
    t_copy = timing([full], own + p)
    t_short = timing([full, subset(base)], own)
    t_long = timing([full, subset(base + p)], own)
    level_token = max(0.0, (t_long - t_short) / p)
    return DeviceCosts(
        level_call_s=max(0.0, t_short - t_base - base * level_token),
        level_token_s=level_token,
        copy_token_s=max(1e-15, (t_copy - t_base) / (batch * p)),
        padded=options.suffix_kernel is None,
    )


def _best(run: Callable[[mx.array], mx.array], q: mx.array) -> float:
    """Seconds per call of `run`: the best of REPEATS chains of CALLS calls (after one unmeasured chain)."""
    best = float("inf")
    for i in range(REPEATS + 1):
        x = q
        t0 = time.perf_counter()
        for _ in range(CALLS):
            x = run(x)
        mx.eval(x)
        if i:
            best = min(best, (time.perf_counter() - t0) / CALLS)
    return best
