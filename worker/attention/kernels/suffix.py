"""CUDA kernel for a cascade decode step: each row's own suffix, merged with what its prefix levels gave.

The prefix levels are attended by mx ops (cascade.attend_level: one matmul per level for all the rows that share
it). What is left per row is short (its own suffix) but costs about ten mx ops per layer: a mask, a score
matmul, softmax pieces, the merge. This kernel does it in one launch: it is ragged.py's decode kernel
(one block per row and kv head, each row starting at its first real key, no mask), started from the prefix's
state instead of from nothing, so its online softmax merges the two exactly.

Only on CUDA (`suffix_decode`); `suffix_decode_reference` is the same contract in mx ops, for tests and for
bench/cascade_step.py, which checks one against the other on the GPU.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from omlx_jobs.worker.attention.kernels import ragged
from omlx_jobs.worker.attention.kernels.cuda import DECODE_HEADER, cuda_kernel, decode_source, scale_array
from omlx_jobs.worker.attention.parts import attend, merge

SOURCE = decode_source(
    """
    // One block per (row, kv head), as the ragged kernel: WARPS warps take every WARPS-th key of the row's own
    // suffix from its first real key on, with an online softmax in base 2. Warp w starts from the prefix parts
    // w, w + WARPS, ... (part p: m = lse, s = 1, o = o_pre: exactly the state after its keys), merged; the warps'
    // states are combined in shared memory at the end, so the parts are merged with the suffix exactly.""",
    declarations="""
    const int parts = lse_pre_shape[0];
    const int part_heads = lse_pre_shape[1];  // B * H: the stride of a part
""",
    start_state="""
        const int head = (b * kv_heads + kvh) * G + g;
        for (int p = w; p < parts; p += BN) {
            const int at = p * part_heads + head;
            const float l2 = lse_pre[at] * LOG2E;
            if (l2 == NEG_INF) continue;
            const float m_new = fmaxf(m[g], l2);
            const float f = exp2f(m[g] - m_new);
            const float e = exp2f(l2 - m_new);
            s[g] = s[g] * f + e;
            for (int i = 0; i < VPT; i++) o[g][i] = o[g][i] * f + e * o_pre[at * D + lane * VPT + i];
            m[g] = m_new;
        }""",
)
_WARPS = 8
_kernel: Any = None


def suffix_decode(
    q: mx.array, k: mx.array, v: mx.array, start: mx.array, o_pre: mx.array, lse_pre: mx.array, scale: float
) -> mx.array:
    """One decode step of each row over its own suffix, merged with its prefix levels' (o_pre, lse_pre) (CUDA).

    q: [B, H, 1, D]; k, v: [B, kv_heads, S, D] (any strides), row b's real keys from start[b] (int32) on;
    o_pre float32 and lse_pre float32: the prefix in one part ([B, H, 1, D] and [B, H, 1], as parts.merge
    returns them) or in several ([P, B, H, D] and [P, B, H], as prefix.prefix_decode returns them for
    a level of every row), lse -inf for a row (or part) without keys. Returns [B, H, 1, D] in q's dtype.
    Shapes: attention.supported.
    """
    global _kernel
    if _kernel is None:
        _kernel = cuda_kernel(
            "omlx_cascade_suffix_decode",
            SOURCE,
            DECODE_HEADER,
            input_names=["q", "k", "v", "start", "o_pre", "lse_pre", "scale"],
            output_names=["out"],
            ensure_row_contiguous=False,
        )
    batch, heads, _, dim = q.shape
    kv_heads = k.shape[1]
    if start.dtype != mx.int32:
        start = start.astype(mx.int32)
    o_pre = mx.contiguous(o_pre).reshape(-1, batch * heads * dim)
    lse_pre = mx.contiguous(lse_pre).reshape(-1, batch * heads)
    (out,) = _kernel(
        inputs=[q, k, v, start, o_pre, lse_pre, scale_array(scale)],
        template=[("T", q.dtype), ("D", dim), ("G", heads // kv_heads), ("WARPS", _WARPS)],
        grid=(batch * kv_heads * _WARPS * 32, 1, 1),
        threadgroup=(_WARPS * 32, 1, 1),
        output_shapes=[(batch, heads, 1, dim)],
        output_dtypes=[q.dtype],
    )
    return out


def suffix_decode_reference(
    q: mx.array, k: mx.array, v: mx.array, start: mx.array, o_pre: mx.array, lse_pre: mx.array, scale: float
) -> mx.array:
    """What suffix_decode computes, with mx ops (any device)."""
    batch, heads, _, dim = q.shape
    o_pre = o_pre.reshape(-1, batch, heads, 1, dim)
    lse_pre = lse_pre.reshape(-1, batch, heads, 1)
    mask = (mx.arange(k.shape[2])[None] >= start[:, None])[:, None, None, :]
    parts = [(o_pre[p], lse_pre[p]) for p in range(o_pre.shape[0])]
    o, _ = merge([*parts, attend(q, k, v, scale, mask)])
    return o.astype(q.dtype)


def supported(heads: int, kv_heads: int, dim: int) -> bool:
    """The shapes the kernel takes: those of the ragged kernel (head sizes 64, 96, 128, 256; G * D <= 1024)."""
    return ragged.supported(heads, kv_heads, dim)
