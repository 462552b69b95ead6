"""Cascade attention: the rows that share a prefix attend to its keys and values once (Hydragen, FlashInfer).

A row's keys are a chain of shared prefix levels (a system prompt, then a document, ...) followed by its own
suffix. Attention over the concatenation is the exact merge of attention over each part, weighted by each
part's log-sum-exp (lse):

    m = max_i lse_i,   o = sum_i exp(lse_i - m) o_i / sum_i exp(lse_i - m),   lse = m + log sum_i exp(lse_i - m)

Attention to a level is one call for all the rows that share it: their queries are folded into the query
dimension ([1, kv_heads, rows * G * N, D] against the level's [1, kv_heads, P, D]), so the level's keys and
values are read once per step however many rows share it, and a decode step becomes a matmul instead of one
matrix-vector product per row.

The portable path is mx ops only, so it runs on the CPU, Metal and CUDA alike. Decode steps are
cascade_decode.py's: on CUDA, inside its `kernel_enabled()`, the levels go through a tensor-core kernel
(cascade_prefix.py: bf16/fp16, head sizes 64/96/128) and the rows' own suffixes through another
(cascade_kernel.py).

The cache that holds the levels and the suffixes is cascade_cache.CascadeKVCache; `install` routes a model's
attention call to `attention` whenever its layer cache is one. Model types: llama, qwen2, qwen3 and mistral
whose layer caches are all mlx-lm's KVCache (no sliding-window layers): their attention applies RoPE at
`cache.offset`, passes mlx-lm's mask and the cache straight to `scaled_dot_product_attention`, and has no
attention sinks (checked for mlx-lm 0.32.2). Other models (rotating or recurrent caches, other attention
code) keep today's path, where each row holds its whole prompt.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from omlx_jobs.worker.attention import fused, ragged

MODEL_TYPES = ragged.MODEL_TYPES  # the attention code they share is wrapped by ragged.wrap
NEG_INF = float("-inf")
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
SCORE_BUDGET = 1 << 26
"""Score-matrix elements per part (256 MB in float32): longer prefills are split into chunks of query positions."""

COMPILE = os.environ.get("OMLX_JOBS_CASCADE_COMPILE", "1") != "0"
"""Compile the mx-ops path on GPUs (Metal, CUDA); OMLX_JOBS_CASCADE_COMPILE=0 runs it op by op."""


@dataclass(frozen=True)
class Level:
    """One shared prefix segment of one layer, and the batch rows that attend to it."""

    keys: mx.array
    """[1, kv_heads, P, D]"""
    values: mx.array
    rows: mx.array | None
    """[r] int32, the batch rows that continue this segment, in order; None when every row does."""
    slot: mx.array | None
    """[B] int32, each batch row's index into `rows` (0 for the rows that do not continue it); None with rows."""
    member: mx.array | None = None
    """[B] bool, whether each batch row continues this segment; None with rows."""


def attend(
    q: mx.array, k: mx.array, v: mx.array, scale: float, mask: mx.array | None = None
) -> tuple[mx.array, mx.array]:
    """softmax(q k^T * scale) v and its log-sum-exp, with mx ops.

    q: [B, H, N, D]; k, v: [B, kv_heads, K, D] (H a multiple of kv_heads); mask: None or bool, broadcastable to
    [B, 1, N, K] (True: attend). Returns o [B, H, N, D] in float32 and lse [B, H, N] (-inf for a query that
    sees no key; its o is 0). The query heads of a kv head are folded together, so keys are not repeated.
    """
    b, h, n, d = q.shape
    kv_heads = k.shape[1]
    g = h // kv_heads
    folded = q.reshape(b, kv_heads, g * n, d)  # row g * n + i: query head g of this kv head, position i
    if mask is None:
        o, lse = _cores()[0](folded, k, v, scale)
    else:
        while mask.ndim < 4:
            mask = mask[None]
        if g > 1:
            mask = mx.tile(mask, (1, 1, g, 1))
        o, lse = _cores()[1](folded, k, v, mask, scale)
    return o.reshape(b, h, n, d), lse.reshape(b, h, n)


def _core(q: mx.array, k: mx.array, v: mx.array, scale: float) -> tuple[mx.array, mx.array]:
    return softmax_v(q, k, v, None, scale)


def _core_masked(q: mx.array, k: mx.array, v: mx.array, mask: mx.array, scale: float) -> tuple[mx.array, mx.array]:
    return softmax_v(q, k, v, mask, scale)


def softmax_v(
    q: mx.array, k: mx.array, v: mx.array, mask: mx.array | None, scale: float, base2: bool = False
) -> tuple[mx.array, mx.array]:
    """q: [B, kv_heads, M, D] against k, v: [B, kv_heads, K, D]; mask broadcastable to [B, kv_heads, M, K].

    No reshapes, so it compiles shapeless. Scores are computed in q's dtype and exponentiated in float32, as
    mlx's own unfused attention does; one exponential per score (the lse comes from the max and the sum). With
    `base2` (CPU decode steps) the scores are in base 2 (log2 e folded into the scale) and exponentiated by
    `_exp2`, whose bit cast does not compile shapeless.
    """
    scores = (q * (scale * LOG2E if base2 else scale)) @ k.swapaxes(-1, -2)
    if mask is not None:
        scores = mx.where(mask, scores, NEG_INF)
    m = scores.max(axis=-1, keepdims=True).astype(mx.float32)
    m = mx.where(m == NEG_INF, 0.0, m)  # a query that sees no key: its weights are all 0
    # The weights in v's dtype (what the matmul reads anyway): a bf16 model's score matrix is written and read as
    # bf16, not float32, and the sum (accumulated in float32 by mlx) normalises exactly the weights used.
    x = scores.astype(mx.float32) - m
    e = (_exp2(x) if base2 else _exp(x)).astype(v.dtype)
    total = e.sum(axis=-1, keepdims=True).astype(mx.float32)
    o = (e @ v).astype(mx.float32) / mx.maximum(total, 1e-30)
    lse = m * LN2 + mx.log(total) if base2 else m + mx.log(total)
    return o, mx.squeeze(lse, -1)


def _exp(x: mx.array) -> mx.array:
    """e**x; on the CPU as 2**(x log2 e), which mlx 0.32.4 computes about 3x as fast as exp there."""
    if mx.default_device() == mx.cpu:
        return mx.power(2.0, x * LOG2E)
    return mx.exp(x)


_EXP2 = (
    1.535336188319500e-4,
    1.339887440266574e-3,
    9.618437357674640e-3,
    5.550332471162809e-2,
    2.402264791363012e-1,
    6.931472028550421e-1,
)


def _exp2(x: mx.array) -> mx.array:
    """2**x for float32 x <= 0 (-inf included: 0), to float32 rounding, in mx ops, for the CPU.

    mlx 0.32.4's CPU `exp` takes about 11.6 ns an element here and `power(2, x)` 4.2 ns; this takes 3.0: 2**x =
    2**n * 2**f with n = round(x) built from its exponent bits and 2**f, f in [-0.5, 0.5], Cephes' exp2f
    polynomial. x below -127 gives 0 (2**-127 is below float32's normal range). Used for decode steps only: in
    the engine's prefill (many score blocks per layer) it measured slower than `power` (bench/RESULTS.md).
    """
    x = mx.maximum(x, -127.0)
    n = mx.round(x)
    f = x - n
    p = f * _EXP2[0] + _EXP2[1]
    for c in _EXP2[2:]:
        p = p * f + c
    p = p * f + 1.0
    return p * mx.view((n.astype(mx.int32) + 127) << 23, mx.float32)


_compiled = (mx.compile(_core, shapeless=True), mx.compile(_core_masked, shapeless=True))


def compiling() -> bool:
    """Compile (fewer, fused kernels, one call) except on the CPU, where mlx compiles with the C++ compiler."""
    return COMPILE and mx.default_device() != mx.cpu


def _cores() -> tuple[Callable[..., Any], Callable[..., Any]]:
    return _compiled if compiling() else (_core, _core_masked)


def attend_level(q: mx.array, level: Level, scale: float) -> tuple[mx.array, mx.array]:
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
    o, lse = attend(folded, level.keys, level.values, scale)
    o = o.reshape(kv_heads, r, gn, d).transpose(1, 0, 2, 3).reshape(r, h, n, d)
    lse = lse.reshape(kv_heads, r, gn).transpose(1, 0, 2).reshape(r, h, n)
    if level.slot is None:
        return o, lse
    assert b == level.slot.shape[0], "a level's slots cover the batch"
    return scatter_rows(o, lse, level.slot, level.member)


def scatter_rows(o: mx.array, lse: mx.array, slot: mx.array, member: mx.array) -> tuple[mx.array, mx.array]:
    """A level's rows' (o, lse) in batch order; o 0 and lse -inf for the rows outside the level (shapeless)."""
    o = mx.where(mx.expand_dims(member, (1, 2, 3)), mx.take(o, slot, axis=0), 0.0)
    return o, mx.where(mx.expand_dims(member, (1, 2)), mx.take(lse, slot, axis=0), NEG_INF)


def merge_pair(o1: mx.array, lse1: mx.array, o2: mx.array, lse2: mx.array) -> tuple[mx.array, mx.array]:
    m = mx.maximum(lse1, lse2)
    m = mx.where(m == NEG_INF, 0.0, m)  # a query that sees nothing in either part
    w1, w2 = mx.exp(lse1 - m), mx.exp(lse2 - m)
    total = w1 + w2
    o = (o1 * w1[..., None] + o2 * w2[..., None]) / mx.maximum(total, 1e-30)[..., None]
    return o, m + mx.log(total)


merge2 = mx.compile(merge_pair, shapeless=True)


def merge(parts: Sequence[tuple[mx.array, mx.array]]) -> tuple[mx.array, mx.array]:
    """The exact merge of attention over disjoint key sets, from each part's (o, lse): attention over their union."""
    fn = merge2 if compiling() else merge_pair
    o, lse = parts[0]
    for o2, lse2 in parts[1:]:
        o, lse = fn(o, lse, o2, lse2)
    return o, lse


def attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    levels: Sequence[Level],
    scale: float,
    mask: mx.array | None,
    start: mx.array | None = None,
    buffers: tuple[mx.array, mx.array] | None = None,
) -> mx.array:
    """Attention of q to each row's prefix levels followed by its own keys k, v (masked by `mask`), in q's dtype.

    q: [B, H, N, D]; k, v: [B, kv_heads, S, D], the rows' own suffixes (left-padded; `start` [B] int32 is each
    row's first real key, used by the decode kernel; `buffers` the own suffixes' whole key and value buffers,
    used by cascade_fused.decode). A decode step (N == 1) is cascade_decode.decode. A prefill chunk is mx ops,
    split into chunks of query positions when long.
    """
    b, h, n, _ = q.shape
    if n == 1:
        return cascade_decode.decode(q, k, v, levels, scale, mask, start, buffers)
    if fused.use_prefill(levels):
        return fused.prefill(q, k, v, levels, scale, mask)
    longest = max([k.shape[2], *(lv.keys.shape[2] for lv in levels)])
    step_n = max(1, SCORE_BUDGET // max(1, b * h * longest))
    outs = []
    for i in range(0, n, step_n):
        qi = q[:, :, i : i + step_n]
        mi = mask if mask is None or mask.shape[-2] == 1 else mask[..., i : i + step_n, :]
        parts = [attend(qi, k, v, scale, mi)] + [attend_level(qi, lv, scale) for lv in levels]
        outs.append(merge(parts)[0])
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)
    return out.astype(q.dtype)


def install(model: Any) -> bool:
    """Route the model module's attention call to `attention` for cascade caches (once); False if not eligible.

    Any other cache goes to the call that was there (mlx-lm's, or the ragged decode wrapper of attention.py), and
    a cascade cache whose batch holds no level goes there too with its own suffix cache, as today's path.
    """
    return ragged.wrap(model, "_omlx_cascade", _route)


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
    layout = getattr(cache, "cascade_layout", None)
    if layout is None:
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
    levels, own = layout()
    if not levels:  # today's path on the own suffixes (the ragged kernel too, if it wraps this call)
        return ragged.route(original, queries, keys, values, own, scale, mask, sinks)
    if sinks is not None:
        raise NotImplementedError("cascade attention has no attention sinks; this model must keep KVCache")
    return attention(queries, keys, values, levels, scale, mask, own.left_padding, (own.keys, own.values))


def eligible(model: Any) -> bool:
    """True if the model's attention can be routed and every layer cache is a plain KVCache (no sliding windows)."""
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    if getattr(model, "model_type", None) not in MODEL_TYPES:
        return False
    return all(type(c) is KVCache for c in make_prompt_cache(model))


from omlx_jobs.worker.attention import cascade_decode  # noqa: E402  (it uses this module's parts; imported last)
