"""Cascade attention: the rows that share a prefix attend to its keys and values once (Hydragen, FlashInfer).

A row's keys are a chain of shared prefix levels (a system prompt, then a document, ...) followed by its own
suffix. Attention over the concatenation is the exact merge of attention over each part, weighted by each
part's log-sum-exp (parts.py).

Attention to a level is one call for all the rows that share it: their queries are folded into the query
dimension ([1, kv_heads, rows * G * N, D] against the level's [1, kv_heads, P, D]), so the level's keys and
values are read once per step however many rows share it, and a decode step becomes a matmul instead of one
matrix-vector product per row.

The portable path is mx ops only, so it runs on the CPU, Metal and CUDA alike. Decode steps are
cascade_decode.py's: on CUDA, with the kernels its options name, the levels go through a tensor-core kernel
(kernels/prefix.py: bf16/fp16, head sizes 64/96/128) and the rows' own suffixes through another
(kernels/suffix.py).

The cache that holds the levels and the suffixes is backend/cascade_cache.CascadeKVCache; routing.py sends a
model's attention call to `attention` whenever its layer cache is one. Model types: llama, qwen2, qwen3 and
mistral whose layer caches are all mlx-lm's KVCache (no sliding-window layers, routing.cascade_eligible): their
attention applies RoPE at `cache.offset`, passes mlx-lm's mask and the cache straight to
`scaled_dot_product_attention`, and has no attention sinks (checked for mlx-lm 0.32.2). Other models (rotating
or recurrent caches, other attention code) keep today's path, where each row holds its whole prompt.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from omlx_jobs.worker.attention import cascade_decode, fused
from omlx_jobs.worker.attention.options import CascadeOptions
from omlx_jobs.worker.attention.packed import Packed
from omlx_jobs.worker.attention.parts import Level, attend, merge, scatter_rows

DEFAULT_OPTIONS = CascadeOptions()
"""How a call outside any routing runs: the switches' defaults, no CUDA kernel."""


def attend_level(q: mx.array, level: Level, scale: float, *, compiled: bool = False) -> tuple[mx.array, mx.array]:
    """Attention of the queries of `level`'s rows to its keys: one call, the rows folded into the query dimension.

    q: [B, H, N, D] for the whole batch. Returns o [B, H, N, D] (float32) and lse [B, H, N] for the whole batch,
    with lse -inf (and o 0) for the rows that do not continue this level.
    """
    b = q.shape[0]
    if level.rows is not None:
        q = mx.take(q, level.rows, axis=0)
    r, h, n, d = q.shape
    kv_heads = level.keys.shape[1]
    gn = (h // kv_heads) * n
    folded = q.reshape(r, kv_heads, gn, d).transpose(1, 0, 2, 3).reshape(1, kv_heads, r * gn, d)
    o, lse = attend(folded, level.keys, level.values, scale, compiled=compiled)
    o = o.reshape(kv_heads, r, gn, d).transpose(1, 0, 2, 3).reshape(r, h, n, d)
    lse = lse.reshape(kv_heads, r, gn).transpose(1, 0, 2).reshape(r, h, n)
    if level.slot is None:
        return o, lse
    assert b == level.slot.shape[0], "a level's slots cover the batch"
    return scatter_rows(o, lse, level.slot, level.member)


def attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    levels: Sequence[Level],
    scale: float,
    mask: mx.array | None,
    start: mx.array | None = None,
    buffers: tuple[mx.array, mx.array] | None = None,
    options: CascadeOptions = DEFAULT_OPTIONS,
    packed: Packed | None = None,
) -> mx.array:
    """Attention of q to each row's prefix levels followed by its own keys k, v (masked by `mask`), in q's dtype.

    q: [B, H, N, D]; k, v: [B, kv_heads, S, D], the rows' own suffixes (left-padded; `start` [B] int32 is each
    row's first real key, used by the decode kernel; `buffers` the own suffixes' whole key and value buffers,
    used by fused.decode; `packed` the levels packed for one call, packed.py, built here when the options pack and
    it is None). A decode step (N == 1) is cascade_decode.decode. A prefill chunk is mx ops, split
    into chunks of query positions when long (options.score_budget).
    """
    b, h, n, _ = q.shape
    if n == 1:
        return cascade_decode.decode(q, k, v, levels, scale, mask, start, buffers, options, packed)
    if fused.use_prefill(levels, options.fused_prefill):
        return fused.prefill(q, k, v, levels, scale, mask)
    compiled = options.compiling
    longest = max([k.shape[2], *(lv.keys.shape[2] for lv in levels)])
    step_n = max(1, options.score_budget // max(1, b * h * longest))
    outs = []
    for i in range(0, n, step_n):
        qi = q[:, :, i : i + step_n]
        mi = mask if mask is None or mask.shape[-2] == 1 else mask[..., i : i + step_n, :]
        parts = [attend(qi, k, v, scale, mi, compiled=compiled)]
        parts += [attend_level(qi, lv, scale, compiled=compiled) for lv in levels]
        outs.append(merge(parts, compiled=compiled)[0])
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)
    return out.astype(q.dtype)
