"""Measuring decode steps: timing, random batch caches, graph sizes, and where a small-context step goes.

Shared by bench/kernels/cascade_step.py; `floor` is its step-floor probe: Python graph construction against
evaluation, steps pipelined as BatchGenerator runs them, graph nodes per step, the projections alone, and an
mx.compile'd fixed-shape step against the same uncompiled.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omlx_jobs.worker.attention import routing
from omlx_jobs.worker.attention.kernels import ragged as attention  # the worker package loads a fast BLAS before mlx
from omlx_jobs.worker.attention.options import Routing

VIEW_PRIMITIVES = frozenset(
    {"Broadcast", "Reshape", "Slice", "Transpose", "ExpandDims", "Squeeze", "AsStrided", "Flatten", "Unflatten"}
)


def timed(fn: Callable[[], Any], iters: int) -> float:
    """Milliseconds per call, each call evaluated before the next (as a decode loop does)."""
    import mlx.core as mx

    for _ in range(3):
        mx.eval(fn())
    mx.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        mx.eval(fn())
    mx.synchronize()
    return (time.perf_counter() - t) / iters * 1000


def stacked_ms(fn: Callable[[], Any], layers: int, iters: int) -> tuple[float, float]:
    """Milliseconds per call when `layers` calls are built and then evaluated at once (as a step runs its layers),
    and of that the milliseconds per call of Python building them (the rest is mlx evaluating them)."""
    import mlx.core as mx

    for _ in range(2):
        mx.eval([fn() for _ in range(layers)])
    mx.synchronize()
    total = build = 0.0
    for _ in range(iters):
        t0 = time.perf_counter()
        outs = [fn() for _ in range(layers)]
        t1 = time.perf_counter()
        mx.eval(outs)
        mx.synchronize()
        total += time.perf_counter() - t0
        build += t1 - t0
    return total / iters / layers * 1000, build / iters / layers * 1000


def random_array(shape: tuple[int, ...], dtype: Any) -> Any:
    import mlx.core as mx

    return mx.random.normal(shape, dtype=dtype)


def own_caches(model: Any, rows: int, length: int, dtype: Any) -> list[Any]:
    """Per-layer BatchKVCache of `rows` rows holding `length` tokens (row 0 left-padded by one: the mask matters)."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    a = model.args
    room = (length + 256 + 255) // 256 * 256
    pad = [1] + [0] * (rows - 1)
    caches = []
    for _ in model.layers:
        c = BatchKVCache(pad)
        c.keys = random_array((rows, a.num_key_value_heads, room, a.head_dim), dtype)
        c.values = random_array((rows, a.num_key_value_heads, room, a.head_dim), dtype)
        c.offset = mx.array([length - p for p in pad])
        c._idx = length
        mx.eval(c.keys, c.values)  # one layer at a time: no large temporaries
        caches.append(c)
    return caches


class _FixedCache:
    """A decode cache of fixed shape for the compile probe: attention over L cached keys, nothing written."""

    def __init__(self, keys: Any, values: Any, offset: Any) -> None:
        self.keys, self.values, self.offset = keys, values, offset

    def update_and_fetch(self, keys: Any, values: Any) -> tuple[Any, Any]:
        return self.keys, self.values

    def make_mask(self, n: int, **kwargs: Any) -> None:
        return None


def graph_nodes(outputs: Any) -> Counter[str]:
    """Primitives in the graph of `outputs` (not yet evaluated), by name."""
    import re
    import tempfile

    import mlx.core as mx

    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(f.name, outputs)
        return Counter(re.findall(r'label ="([^"]+)", shape=rectangle', Path(f.name).read_text()))


def weights_ms(model: Any, rows: int, iters: int, dtype: Any) -> float:
    """Every projection of the model applied to `rows` vectors, nothing else: the weight-reading floor."""
    import mlx.core as mx
    import mlx.nn as nn

    linears = [m for _, m in model.named_modules() if isinstance(m, nn.Linear | nn.QuantizedLinear)]
    inputs = {}
    for m in linears:
        width = m.weight.shape[1] * (32 // m.bits if isinstance(m, nn.QuantizedLinear) else 1)
        inputs.setdefault(width, mx.random.normal((rows, 1, width), dtype=dtype))
    mx.eval(list(inputs.values()))
    return timed(lambda: [m(inputs[m.weight.shape[1] * (32 // getattr(m, "bits", 32))]) for m in linears], iters)


def pipelined_ms(model: Any, caches: list[Any], tokens: Any, start: list[int], iters: int) -> float:
    """Steps as BatchGenerator runs them: the next step's graph is built while this one runs (async_eval)."""
    import mlx.core as mx

    y = tokens
    mx.synchronize()
    t = time.perf_counter()
    for i in range(iters + 1):
        if i == 1:
            mx.eval(y)
            t = time.perf_counter()  # from the second step on: the first has nothing to overlap with
        for c, s in zip(caches, start, strict=True):
            c._idx = s
        nxt = mx.argmax(model(y, cache=caches)[:, -1], axis=-1)[:, None]
        mx.async_eval(nxt)
        if i > 0:
            mx.eval(y)
        y = nxt
    mx.eval(y)
    return (time.perf_counter() - t) / iters * 1000


def floor(model: Any, rows: int, length: int, iters: int, dtype: Any, cuda: bool) -> None:
    """Where a small-context decode step's time goes (today's path, ragged kernel on CUDA)."""
    import mlx.core as mx

    caches = own_caches(model, rows, length, dtype)
    tokens = mx.array([[7]] * rows)
    start = [c._idx for c in caches]
    build = run = 0.0
    with routing.active(Routing(ragged=attention.ragged_decode)) if cuda else contextlib.nullcontext():
        mx.eval(model(tokens, cache=caches))
        for c, s in zip(caches, start, strict=True):
            c._idx = s
        probe = model(tokens, cache=caches)
        nodes = graph_nodes(probe)
        mx.eval(probe)
        for _ in range(iters):
            for c, s in zip(caches, start, strict=True):
                c._idx = s
            t0 = time.perf_counter()
            logits = model(tokens, cache=caches)
            t1 = time.perf_counter()
            mx.eval(logits)
            mx.synchronize()
            build += t1 - t0
            run += time.perf_counter() - t1
        pipelined = pipelined_ms(model, caches, tokens, start, iters)
    compute = sum(n for name, n in nodes.items() if name not in VIEW_PRIMITIVES)
    top = ", ".join(f"{name} {n}" for name, n in nodes.most_common(8))
    print(
        f"floor B={rows:3d} L={length}: step {(build + run) / iters * 1000:7.2f} ms = graph construction "
        f"{build / iters * 1000:6.2f} + eval {run / iters * 1000:7.2f}; pipelined as BatchGenerator "
        f"{pipelined:7.2f}; nodes {sum(nodes.values())} ({compute} not views): {top}",
        flush=True,
    )
    weights = weights_ms(model, rows, iters, dtype)

    kvs = [(c.keys[..., :length, :], c.values[..., :length, :]) for c in caches]
    offset = mx.array([length] * rows)
    mx.eval(kvs)

    def fixed(tokens: Any, offset: Any, *flat: Any) -> Any:
        fixed_caches = [_FixedCache(flat[2 * i], flat[2 * i + 1], offset) for i in range(len(flat) // 2)]
        return model(tokens, cache=fixed_caches)

    flat = [x for kv in kvs for x in kv]
    compiled = mx.compile(fixed)
    plain_ms = timed(lambda: fixed(tokens, offset, *flat), iters)
    t0 = time.perf_counter()
    mx.eval(compiled(tokens, offset, *flat))
    trace_ms = (time.perf_counter() - t0) * 1000
    compiled_ms = timed(lambda: compiled(tokens, offset, *flat), iters)
    t0 = time.perf_counter()
    for _ in range(iters):
        compiled(tokens, offset, *flat)
    call_ms = (time.perf_counter() - t0) / iters * 1000
    print(
        f"floor B={rows:3d} L={length}: projections alone {weights:6.2f} ms; fixed-shape step (no mask, keys not "
        f"written) {plain_ms:6.2f} ms, compiled {compiled_ms:6.2f} ms (first call with tracing {trace_ms:.0f} ms, "
        f"a compiled call's Python side {call_ms:.3f} ms)",
        flush=True,
    )
    del caches, kvs
    mx.clear_cache()
