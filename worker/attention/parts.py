"""Attention over disjoint parts of the keys, merged exactly by each part's log-sum-exp (lse), in mx ops.

Attention over a concatenation of key sets is the merge of attention over each set, weighted by its lse:

    m = max_i lse_i,   o = sum_i exp(lse_i - m) o_i / sum_i exp(lse_i - m),   lse = m + log sum_i exp(lse_i - m)

`attend` gives one part's (o, lse), `merge` merges parts, and a `Level` is one shared prefix segment with the
batch rows that attend to it (cascade.py). Portable: the CPU, Metal and CUDA run the same ops; `compiled` asks
for mlx's shapeless compile (GPUs: fewer, fused kernels), which the CPU runs through its C++ compiler instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx

NEG_INF = float("-inf")
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


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
    q: mx.array, k: mx.array, v: mx.array, scale: float, mask: mx.array | None = None, *, compiled: bool = False
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
    core, core_masked = _COMPILED if compiled else (_core, _core_masked)
    if mask is None:
        o, lse = core(folded, k, v, scale)
    else:
        while mask.ndim < 4:
            mask = mask[None]
        if g > 1:
            mask = mx.tile(mask, (1, 1, g, 1))
        o, lse = core_masked(folded, k, v, mask, scale)
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


_COMPILED = (mx.compile(_core, shapeless=True), mx.compile(_core_masked, shapeless=True))


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


_merge2 = mx.compile(merge_pair, shapeless=True)


def merge(parts: Sequence[tuple[mx.array, mx.array]], *, compiled: bool = False) -> tuple[mx.array, mx.array]:
    """The exact merge of attention over disjoint key sets, from each part's (o, lse): attention over their union."""
    fn = _merge2 if compiled else merge_pair
    o, lse = parts[0]
    for o2, lse2 in parts[1:]:
        o, lse = fn(o, lse, o2, lse2)
    return o, lse
