"""Decode attention for a left-padded batch without a mask, on CUDA.

mlx-lm's BatchKVCache keeps rows of different lengths left-padded and hides the padding with an array mask.
With mlx 0.32.4 on CUDA an array mask takes decode attention off the fused kernel. The kernel here starts
each row at its first real key instead, so it needs no mask: on an H200, one decode step of a Qwen3-8B shape
over 1,056 cached tokens takes 17.8 ms instead of 24.8 ms at batch 32, and 25.5 ms instead of 59.0 ms at
batch 128 (bench/decode_step.py, bench/RESULTS.md).

Used only where the routing a backend made active names it (on CUDA, unless OMLX_JOBS_RAGGED_DECODE=0:
routing.py), and only by model types whose attention hands mlx-lm's mask and cache straight to
`scaled_dot_product_attention`: everything else takes mlx-lm's own path unchanged.
"""

from __future__ import annotations

import hashlib
from typing import Any

import mlx.core as mx

HEAD_DIMS = frozenset({64, 96, 128, 256})
_WARPS = 8  # 256 threads: room for 255 registers each (the G query heads are kept in registers)

_SOURCE = """
    // One block per (row, kv head); its G query heads share each key and value load. WARPS warps take every
    // WARPS-th key from the row's first real key on, with an online softmax; then the warps' partial results
    // are combined in shared memory.
    constexpr int BN = WARPS;
    constexpr int VPT = D / 32;        // dims per lane
    auto block = cg::this_thread_block();
    auto warp = cg::tiled_partition<32>(block);
    const int lane = warp.thread_rank();
    const int w = warp.meta_group_rank();
    const int kv_heads = k_shape[1];
    const int b = blockIdx.x / kv_heads;
    const int kvh = blockIdx.x % kv_heads;
    const int length = k_shape[2];
    const float scale_log2 = scale[0] * 1.44269504088896340736f;

    const T* kp = k + b * k_strides[0] + kvh * k_strides[1] + lane * VPT;
    const T* vp = v + b * v_strides[0] + kvh * v_strides[1] + lane * VPT;
    float qv[G][VPT], o[G][VPT], m[G], s[G];
    for (int g = 0; g < G; g++) {
        const T* qp = q + b * q_strides[0] + (kvh * G + g) * q_strides[1] + lane * VPT;
        for (int i = 0; i < VPT; i++) {
            qv[g][i] = scale_log2 * static_cast<float>(qp[i]);
            o[g][i] = 0.f;
        }
        m[g] = NEG_INF;
        s[g] = 0.f;
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

_kernel: Any = None
_scales: dict[float, mx.array] = {}  # one small device array per model scale, not one per layer call


def available() -> bool:
    """True where the kernel can run: mlx's CUDA backend is the default device.

    Whether to use it is Switches.ragged_decode's (OMLX_JOBS_RAGGED_DECODE=0 turns it off)."""
    try:
        return bool(mx.cuda.is_available()) and mx.default_device() == mx.gpu
    except AttributeError:
        return False


def supported(heads: int, kv_heads: int, dim: int) -> bool:
    """Shapes the kernel handles: the usual head sizes, and few enough query heads per kv head to keep in registers."""
    return dim in HEAD_DIMS and heads % kv_heads == 0 and (heads // kv_heads) * dim <= 1024


def cuda_kernel(name: str, source: str, header: str, **kwargs: Any) -> Any:
    """mx.fast.cuda_kernel under `kernel_name`: mlx 0.32.4 caches compiled kernels on disk by name alone."""
    return mx.fast.cuda_kernel(name=kernel_name(name, source, header), source=source, header=header, **kwargs)


def kernel_name(name: str, source: str, header: str) -> str:
    """The name with a hash of the kernel's code. mlx 0.32.4 keeps compiled custom kernels in MLX_PTX_CACHE_DIR
    (default <tmp>/mlx/<version>/ptx) under their name and template arguments only: a kernel changed by an upgrade
    of omlx-jobs under its old name would run the old binary."""
    return f"{name}_{hashlib.sha1((header + chr(0) + source).encode()).hexdigest()[:12]}"


def ragged_decode(q: mx.array, k: mx.array, v: mx.array, start: mx.array, scale: float) -> mx.array:
    """softmax(q k^T * scale) v for one query per row, row b attending to keys start[b]: (CUDA kernel).

    q: [B, heads, 1, D]; k, v: [B, kv_heads, L, D] (any strides); start: [B] int32.
    """
    global _kernel
    if _kernel is None:
        _kernel = cuda_kernel(
            "omlx_ragged_decode",
            _SOURCE,
            "#include <cooperative_groups/reduce.h>\n#define NEG_INF __int_as_float(0xff800000)\n",
            input_names=["q", "k", "v", "start", "scale"],
            output_names=["out"],
            ensure_row_contiguous=False,
        )
    batch, heads, _, dim = q.shape
    kv_heads = k.shape[1]
    if scale not in _scales:
        _scales[scale] = mx.array([scale], dtype=mx.float32)
    if start.dtype != mx.int32:
        start = start.astype(mx.int32)
    (out,) = _kernel(
        inputs=[q, k, v, start, _scales[scale]],
        template=[("T", q.dtype), ("D", dim), ("G", heads // kv_heads), ("WARPS", _WARPS)],
        grid=(batch * kv_heads * _WARPS * 32, 1, 1),
        threadgroup=(_WARPS * 32, 1, 1),
        output_shapes=[(batch, heads, 1, dim)],
        output_dtypes=[q.dtype],
    )
    return out


def ragged_reference(q: mx.array, k: mx.array, v: mx.array, start: mx.array, scale: float) -> mx.array:
    """What ragged_decode computes, with mlx ops and a mask (any device; for tests)."""
    mask = (mx.arange(k.shape[2])[None] >= start[:, None])[:, None, None, :]
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
