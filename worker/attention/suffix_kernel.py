"""CUDA kernel for a cascade decode step: each row's own suffix, merged with what its prefix levels gave.

The prefix levels are attended by mx ops (cascade.attend_level: one matmul per level for all the rows that share
it). What is left per row is short (its own suffix) but costs about ten mx ops per layer: a mask, a score
matmul, softmax pieces, the merge. This kernel does it in one launch: it is attention.py's ragged decode kernel
(one block per row and kv head, each row starting at its first real key, no mask), started from the prefix's
state instead of from nothing, so its online softmax merges the two exactly.

Only on CUDA (`suffix_decode`); `suffix_decode_reference` is the same contract in mx ops, for tests and for
bench/cascade_step.py, which checks one against the other on the GPU.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from omlx_jobs.worker.attention import ragged
from omlx_jobs.worker.attention.parts import attend, merge

_SOURCE = """
    // One block per (row, kv head), as the ragged kernel: WARPS warps take every WARPS-th key of the row's own
    // suffix from its first real key on, with an online softmax in base 2. Warp w starts from the prefix parts
    // w, w + WARPS, ... (part p: m = lse, s = 1, o = o_pre: exactly the state after its keys), merged; the warps'
    // states are combined in shared memory at the end, so the parts are merged with the suffix exactly.
    constexpr int BN = WARPS;
    constexpr int VPT = D / 32;
    auto block = cg::this_thread_block();
    auto warp = cg::tiled_partition<32>(block);
    const int lane = warp.thread_rank();
    const int w = warp.meta_group_rank();
    const int kv_heads = k_shape[1];
    const int b = blockIdx.x / kv_heads;
    const int kvh = blockIdx.x % kv_heads;
    const int length = k_shape[2];
    const float scale_log2 = scale[0] * LOG2E;

    const T* kp = k + b * k_strides[0] + kvh * k_strides[1] + lane * VPT;
    const T* vp = v + b * v_strides[0] + kvh * v_strides[1] + lane * VPT;
    const int parts = lse_pre_shape[0];
    const int part_heads = lse_pre_shape[1];  // B * H: the stride of a part
    float qv[G][VPT], o[G][VPT], m[G], s[G];
    for (int g = 0; g < G; g++) {
        const int head = (b * kv_heads + kvh) * G + g;
        const T* qp = q + b * q_strides[0] + (kvh * G + g) * q_strides[1] + lane * VPT;
        for (int i = 0; i < VPT; i++) {
            qv[g][i] = scale_log2 * static_cast<float>(qp[i]);
            o[g][i] = 0.f;
        }
        m[g] = NEG_INF;
        s[g] = 0.f;
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
        }
    }
    for (int j = start[b] + w; j < length; j += BN) {
        float kj[VPT], vj[VPT];
        for (int i = 0; i < VPT; i++) {
            kj[i] = static_cast<float>(kp[j * k_strides[2] + i]);
            vj[i] = static_cast<float>(vp[j * v_strides[2] + i]);
        }
        for (int g = 0; g < G; g++) {
            float score = 0.f;
            for (int i = 0; i < VPT; i++) score += qv[g][i] * kj[i];
            score = cg::reduce(warp, score, cg::plus<float>());
            const float m_new = fmaxf(m[g], score);
            const float f = exp2f(m[g] - m_new);
            const float e = exp2f(score - m_new);
            s[g] = s[g] * f + e;
            for (int i = 0; i < VPT; i++) o[g][i] = o[g][i] * f + e * vj[i];
            m[g] = m_new;
        }
    }

    __shared__ float sm_m[BN];
    __shared__ float sm_s[BN];
    __shared__ float sm_o[BN][D];
    const int t = block.thread_rank();
    for (int g = 0; g < G; g++) {
        if (lane == 0) {
            sm_m[w] = m[g];
            sm_s[w] = s[g];
        }
        for (int i = 0; i < VPT; i++) sm_o[w][lane * VPT + i] = o[g][i];
        block.sync();
        if (t < D) {
            float mm = NEG_INF;
            for (int i = 0; i < BN; i++) mm = fmaxf(mm, sm_m[i]);
            float ss = 0.f, oo = 0.f;
            for (int i = 0; i < BN; i++) {
                const float f = sm_m[i] == NEG_INF ? 0.f : exp2f(sm_m[i] - mm);
                ss += sm_s[i] * f;
                oo += sm_o[i][t] * f;
            }
            out[(b * kv_heads * G + kvh * G + g) * D + t] = static_cast<T>(oo / ss);
        }
        block.sync();
    }
"""

_HEADER = (
    "#include <cooperative_groups/reduce.h>\n"
    "#define NEG_INF __int_as_float(0xff800000)\n"
    "#define LOG2E 1.44269504088896340736f\n"
)
_WARPS = 8
_kernel: Any = None
_scales: dict[float, mx.array] = {}


def suffix_decode(
    q: mx.array, k: mx.array, v: mx.array, start: mx.array, o_pre: mx.array, lse_pre: mx.array, scale: float
) -> mx.array:
    """One decode step of each row over its own suffix, merged with its prefix levels' (o_pre, lse_pre) (CUDA).

    q: [B, H, 1, D]; k, v: [B, kv_heads, S, D] (any strides), row b's real keys from start[b] (int32) on;
    o_pre float32 and lse_pre float32: the prefix in one part ([B, H, 1, D] and [B, H, 1], as cascade.merge
    returns them) or in several ([P, B, H, D] and [P, B, H], as cascade_prefix.prefix_decode returns them for
    a level of every row), lse -inf for a row (or part) without keys. Returns [B, H, 1, D] in q's dtype.
    Shapes: attention.supported.
    """
    global _kernel
    if _kernel is None:
        _kernel = ragged.cuda_kernel(
            "omlx_cascade_suffix_decode",
            _SOURCE,
            _HEADER,
            input_names=["q", "k", "v", "start", "o_pre", "lse_pre", "scale"],
            output_names=["out"],
            ensure_row_contiguous=False,
        )
    batch, heads, _, dim = q.shape
    kv_heads = k.shape[1]
    if scale not in _scales:
        _scales[scale] = mx.array([scale], dtype=mx.float32)
    if start.dtype != mx.int32:
        start = start.astype(mx.int32)
    o_pre = mx.contiguous(o_pre).reshape(-1, batch * heads * dim)
    lse_pre = mx.contiguous(lse_pre).reshape(-1, batch * heads)
    (out,) = _kernel(
        inputs=[q, k, v, start, o_pre, lse_pre, _scales[scale]],
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
