"""CUDA custom kernels: their names (hashed by code), and the online-softmax decode loop two of them share.

ragged.py's decode kernel and suffix.py's are the same loop: one block per (row, kv head), WARPS warps
taking every WARPS-th key of the row from its first real key on with an online softmax in base 2, the warps'
states combined in shared memory at the end. The suffix kernel only starts each head's state from the prefix
levels' parts instead of from nothing. `decode_source` writes that loop once; each kernel adds its declarations
and its starting state. (prefix.py's tensor-core kernel is another loop: tiles of keys through mma.sync.)
"""

from __future__ import annotations

import hashlib
from typing import Any

import mlx.core as mx

DECODE_HEADER = (
    "#include <cooperative_groups/reduce.h>\n"
    "#define NEG_INF __int_as_float(0xff800000)\n"
    "#define LOG2E 1.44269504088896340736f\n"
)
"""The header of the kernels `decode_source` writes."""

_SETUP = """
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
    const float scale_log2 = scale[0] * LOG2E;

    const T* kp = k + b * k_strides[0] + kvh * k_strides[1] + lane * VPT;
    const T* vp = v + b * v_strides[0] + kvh * v_strides[1] + lane * VPT;
"""

_STATE = """
    float qv[G][VPT], o[G][VPT], m[G], s[G];
    for (int g = 0; g < G; g++) {
        const T* qp = q + b * q_strides[0] + (kvh * G + g) * q_strides[1] + lane * VPT;
        for (int i = 0; i < VPT; i++) {
            qv[g][i] = scale_log2 * static_cast<float>(qp[i]);
            o[g][i] = 0.f;
        }
        m[g] = NEG_INF;
        s[g] = 0.f;
"""

_KEYS_AND_COMBINE = """
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


def decode_source(comment: str, *, declarations: str = "", start_state: str = "") -> str:
    """The body of an online-softmax decode kernel (inputs q, k, v, start, scale; output out; templates T, D, G,
    WARPS): `comment` first, `declarations` after the setup, and `start_state` inside each head's initialisation,
    after its state is zeroed (head g of kv head kvh; the suffix kernel merges the prefix's parts there)."""
    return comment + _SETUP + declarations + _STATE + start_state + _KEYS_AND_COMBINE


def kernel_name(name: str, source: str, header: str) -> str:
    """The name with a hash of the kernel's code. mlx 0.32.4 keeps compiled custom kernels in MLX_PTX_CACHE_DIR
    (default <tmp>/mlx/<version>/ptx) under their name and template arguments only: a kernel changed by an upgrade
    of omlx-jobs under its old name would run the old binary."""
    return f"{name}_{hashlib.sha1((header + chr(0) + source).encode()).hexdigest()[:12]}"


def cuda_kernel(name: str, source: str, header: str, **kwargs: Any) -> Any:
    """mx.fast.cuda_kernel under `kernel_name`: mlx 0.32.4 caches compiled kernels on disk by name alone."""
    return mx.fast.cuda_kernel(name=kernel_name(name, source, header), source=source, header=header, **kwargs)


_scales: dict[float, mx.array] = {}


def scale_array(scale: float) -> mx.array:
    """The scale as a one-element float32 device array, one per model scale (not one per layer call)."""
    if scale not in _scales:
        _scales[scale] = mx.array([scale], dtype=mx.float32)
    return _scales[scale]
