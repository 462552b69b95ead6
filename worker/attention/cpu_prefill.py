"""Prefill attention on the CPU: causal blocks of queries, each against only the keys it can see.

On the CPU, mlx 0.32.4's `scaled_dot_product_attention` with a mask has no fused kernel: it computes every
query against every key (the masked half of a causal prefill too) and exponentiates with `exp`, which is about
4x slower there than `2**x` (parts.py `_exp2`). A warm-up prefill of a 2,000-token document then takes most of
its time in attention. Here the queries go in blocks; a block attends to the keys up to its last position only
(the later ones are masked by causality), through parts.py's mx-ops attention. The result is the same
attention, to float rounding.

Every mask mlx-lm builds for these model types is causal in cache positions (`create_causal_mask`: query i
at cache position offset + i sees no key after it; padding only masks more), so the cut is exact for "causal"
and for the boolean masks of BatchKVCache. Other masks (additive, or any whose last two axes are not the
queries and the cache's keys) keep mlx's path, as do decode steps, models with sinks and any device but the CPU.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from omlx_jobs.worker.attention.parts import attend

MIN_QUERIES = 32
"""Shorter chunks (decode steps, short suffixes) keep mlx's path: there is little to cut."""
BLOCK = 64
"""Query positions per block: the masked part computed is about BLOCK / 2 keys per query."""


def applies(queries: mx.array, keys: mx.array, cache: Any, mask: Any, sinks: Any) -> bool:
    """Whether this prefill chunk can go through `attention` (see the module docstring): only with mlx-lm's
    KVCache or BatchKVCache, whose keys are in position order. Never for a cascade cache (its keys are only the
    rows' own: cascade.py attends to its levels). Whether it does is the routing's (Switches.cpu_prefill)."""
    if sinks is not None or mx.default_device() != mx.cpu or queries.shape[2] < MIN_QUERIES:
        return False
    if cache is not None and type(cache) not in (KVCache, BatchKVCache):
        return False  # a cascade cache (cascade.py attends to its levels), rotating or quantized caches: mlx's path
    if isinstance(mask, str):
        return mask == "causal"
    return (
        isinstance(mask, mx.array) and mask.dtype == mx.bool_ and mask.shape[-2:] == (queries.shape[2], keys.shape[2])
    )


def attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    scale: float,
    mask: mx.array | str,
    *,
    block: int = BLOCK,
    compiled: bool = False,
) -> mx.array:
    """Causal attention of q [B, H, N, D] to k, v [B, kv_heads, K, D], the N queries at the last N cache positions.

    `mask`: "causal" or a boolean mask [..., N, K] (True: attend) that is causal in cache positions; `block`
    query positions attend together; `compiled`: as cascade attention's mx ops (Switches.cascade_compile).
    """
    n, total = q.shape[2], k.shape[2]
    offset = total - n
    outs = []
    for i in range(0, n, block):
        j = min(n, i + block)
        end = offset + j  # the last query of this block sees keys [0, end)
        if isinstance(mask, str):
            block_mask = mx.arange(offset + i, end)[:, None] >= mx.arange(end)[None]
        else:
            block_mask = mask[..., i:j, :end]
        o, _ = attend(q[:, :, i:j], k[:, :, :end], v[:, :, :end], scale, block_mask, compiled=compiled)
        outs.append(o.astype(q.dtype))
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)
