"""Batches for cascade attention checks (tests/test_cascade.py, bench/kernels/cascade_step.py): no pytest needed.

Rows with left-padded own suffixes of different lengths, 1- and 2-level prefix chains, several groups and a row
with no prefix; the reference is mx.fast.scaled_dot_product_attention per row over its concatenated keys.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx

from omlx_jobs.worker.attention.parts import Level

# Two groups: rows 0-4 share a system prompt (segment 0); rows 0-2 continue document A (1), rows 3-4 document B
# (2); row 5 has the system prompt only; row 6 is another group (3); row 7 has no shared prefix.
SEGMENTS = [37, 21, 14, 9]
CHAINS = [[0, 1], [0, 1], [0, 1], [0, 2], [0, 2], [0], [3], []]
OWN = [5, 9, 6, 12, 7, 8, 10, 11]


def levels_for(chains: list[list[int]], segs: list[tuple[mx.array, mx.array]]) -> list[Level]:
    out = []
    for s, (k, v) in enumerate(segs):
        rows = [b for b, chain in enumerate(chains) if s in chain]
        if not rows:
            continue
        if len(rows) == len(chains):
            out.append(Level(k, v, None, None))
            continue
        slot, member = [0] * len(chains), [False] * len(chains)
        for i, b in enumerate(rows):
            slot[b], member[b] = i, True
        out.append(Level(k, v, mx.array(rows, mx.int32), mx.array(slot, mx.int32), mx.array(member)))
    return out


def case(
    *, heads: int, kv_heads: int, dim: int, n: int, dtype: mx.Dtype, chains=CHAINS, own=OWN, segments=SEGMENTS, seed=0
):
    """Inputs of cascade.attention for the batch above and the reference output, per row, in float32."""
    mx.random.seed(seed)
    b = len(chains)
    width = max(own)
    pad = [width - x for x in own]
    q = mx.random.normal((b, heads, n, dim)).astype(dtype)
    k = mx.random.normal((b, kv_heads, width, dim)).astype(dtype)
    v = mx.random.normal((b, kv_heads, width, dim)).astype(dtype)
    segs = [
        (mx.random.normal((1, kv_heads, p, dim)).astype(dtype), mx.random.normal((1, kv_heads, p, dim)).astype(dtype))
        for p in segments
    ]
    start = mx.array(pad, mx.int32)
    # What BatchKVCache.make_mask gives: the last n own tokens are the queries, causal, padding hidden.
    rinds = mx.arange(width)[None]
    linds = mx.arange(width - n, width)[:, None]
    mask = (linds >= rinds)[None, None] & (start[:, None, None, None] <= rinds)
    refs = []
    for row, chain in enumerate(chains):
        keys = [segs[s][0] for s in chain] + [k[row : row + 1, :, pad[row] :]]
        values = [segs[s][1] for s in chain] + [v[row : row + 1, :, pad[row] :]]
        prefix = sum(segments[s] for s in chain)
        total = prefix + own[row]
        visible = mx.arange(total)[None] <= (prefix + own[row] - n + mx.arange(n))[:, None]
        refs.append(
            mx.fast.scaled_dot_product_attention(
                q[row : row + 1].astype(mx.float32),
                mx.concatenate(keys, axis=2).astype(mx.float32),
                mx.concatenate(values, axis=2).astype(mx.float32),
                scale=dim**-0.5,
                mask=visible,
            )
        )
    return q, k, v, levels_for(chains, segs), mask, start, mx.concatenate(refs)


def count_calls(monkeypatch: Any, owner: Any, name: str) -> Callable[[], int]:
    """Replace owner.name (through pytest's monkeypatch) by a wrapper that counts its calls; returns the count."""
    real = getattr(owner, name)
    calls = [0]

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return lambda: calls[0]
