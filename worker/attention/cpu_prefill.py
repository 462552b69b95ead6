"""Prefill attention on the CPU: causal blocks of queries, each against only the keys it can see.

On the CPU, mlx 0.32.4's `scaled_dot_product_attention` with a mask has no fused kernel: it computes every
query against every key (the masked half of a causal prefill too) and exponentiates with `exp`, which is about
4x slower there than `2**x` (cascade.py `_exp2`). A warm-up prefill of a 2,000-token document then takes most of
its time in attention. Here the queries go in blocks; a block attends to the keys up to its last position only
(the later ones are masked by causality), through cascade.py's mx-ops attention. The result is the same
attention, to float rounding.

Every mask mlx-lm builds for these model types is causal in cache positions (`create_causal_mask`: query i
at cache position offset + i sees no key after it; padding only masks more), so the cut is exact for "causal"
and for the boolean masks of BatchKVCache. Other masks (additive, or any whose last two axes are not the
queries and the cache's keys) keep mlx's path, as do decode steps, models with sinks and any device but the CPU.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from omlx_jobs.worker.attention import cascade
from omlx_jobs.worker.attention.ragged import wrap

ENABLED = os.environ.get("OMLX_JOBS_CPU_PREFILL", "1") != "0"
"""OMLX_JOBS_CPU_PREFILL=0 leaves every prefill chunk to mlx's attention (as before this module)."""
MIN_QUERIES = 32
"""Shorter chunks (decode steps, short suffixes) keep mlx's path: there is little to cut."""
BLOCK = 64
"""Query positions per block: the masked part computed is about BLOCK / 2 keys per query."""


def applies(queries: mx.array, keys: mx.array, cache: Any, mask: Any, sinks: Any) -> bool:
    """Whether this prefill chunk goes through `attention` (see the module docstring): only with mlx-lm's KVCache
    or BatchKVCache, whose keys are in position order. Never for a cascade cache (its keys are only the rows'
    own: cascade.py attends to its levels), whichever wrapper runs first."""
    if not ENABLED or sinks is not None or mx.default_device() != mx.cpu or queries.shape[2] < MIN_QUERIES:
        return False
    if cache is not None and type(cache) not in (KVCache, BatchKVCache):
        return False  # a cascade cache (cascade.py attends to its levels), rotating or quantized caches: mlx's path
    if isinstance(mask, str):
        return mask == "causal"
    return (
        isinstance(mask, mx.array) and mask.dtype == mx.bool_ and mask.shape[-2:] == (queries.shape[2], keys.shape[2])
    )


def attention(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: mx.array | str) -> mx.array:
    """Causal attention of q [B, H, N, D] to k, v [B, kv_heads, K, D], the N queries at the last N cache positions.

    `mask`: "causal" or a boolean mask [..., N, K] (True: attend) that is causal in cache positions.
    """
    n, total = q.shape[2], k.shape[2]
    offset = total - n
    outs = []
    for i in range(0, n, BLOCK):
        j = min(n, i + BLOCK)
        end = offset + j  # the last query of this block sees keys [0, end)
        if isinstance(mask, str):
            block_mask = mx.arange(offset + i, end)[:, None] >= mx.arange(end)[None]
        else:
            block_mask = mask[..., i:j, :end]
        o, _ = cascade.attend(q[:, :, i:j], k[:, :, :end], v[:, :, :end], scale, block_mask)
        outs.append(o.astype(q.dtype))
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)


def install(model: Any) -> bool:
    """Wrap the model module's scaled_dot_product_attention (once) so CPU prefill chunks go through `attention`.

    False if the model type is not one whose attention passes mlx-lm's mask and cache straight to that call.
    Installed first, so the ragged and cascade wrappers (attention.py, cascade.py) call it for what they pass on.
    """
    return wrap(model, "_omlx_cpu_prefill", _route)


def _route(
    original: Callable[..., mx.array],
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    cache: Any,
    scale: float,
    mask: Any,
    sinks: Any,
) -> mx.array:
    if applies(queries, keys, cache, mask, sinks):
        return attention(queries, keys, values, scale, mask)
    return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
