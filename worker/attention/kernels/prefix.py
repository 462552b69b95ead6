"""CUDA kernel for a cascade decode step's prefix levels: all the rows' queries against one level, on tensor cores.

In a decode step, the rows that share a prefix level attend to it together: for each kv head, the rows' G query
heads are M = rows * G queries against the level's P keys (512 x 3,072 for 128 rows of a Qwen3-8B shape). In
mx ops that is two matmuls, two reductions and an exponent over an M x P score matrix written to memory
(parts.softmax_v); here it is one launch that keeps the scores in registers (flash-decoding): each block takes
16 * WARPS queries of one kv head and one split of the keys, computes S = Q K^T and O = P V with bf16/fp16
`mma.sync` (m16n8k16, float32 accumulators) over tiles of 32 keys (copied to shared memory asynchronously, the
next while this one is used), with an online softmax in base 2, and writes
its split's o and log-sum-exp. The splits of a level are merged exactly by their lse (`merge_splits`), as the
levels are (parts.merge); the rows' own suffixes are then merged in suffix.suffix_decode.

Only on CUDA, for bfloat16 and float16 models with head sizes 64, 96 and 128 (`supported`); float32 and other head
sizes keep the mx ops. `prefix_decode_reference` is the same contract in mx ops, for tests and for
bench/cascade_step.py's check on the GPU.
"""

from __future__ import annotations

import math
import re
from typing import Any

import mlx.core as mx

from omlx_jobs.worker.attention.kernels.cuda import cuda_kernel, scale_array
from omlx_jobs.worker.attention.parts import NEG_INF, attend

HEAD_DIMS = frozenset({64, 96, 128})
DTYPES = (mx.bfloat16, mx.float16)
KEY_TILE = 32
"""Keys per shared-memory tile (two tiles of keys and values, double-buffered: 35 KB at head size 128)."""
MIN_SPLIT = 256
"""Keys per split at least: fewer, and merging the splits costs more than the parallelism they buy."""
TARGET_BLOCKS = 264
"""Blocks to aim for (two per SM of an H100/H200): the splits of the keys make up for few query tiles."""
_WARPS = 4  # 16 queries per warp: 64 per block

_HEADER = """
#define NEG_INF __int_as_float(0xff800000)
#define LOG2E 1.44269504088896340736f
#define LN2 0.69314718055994530942f

__device__ __forceinline__ uint32_t pack2(float a, float b, __nv_bfloat16) {
    __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
}
__device__ __forceinline__ uint32_t pack2(float a, float b, __half) {
    __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
}
// c (16x8, float32) += a (16x16, row-major) * b (16x8, column-major): one warp, PTX's m16n8k16 fragment layouts.
__device__ __forceinline__ void mma(float* c, const uint32_t* a, uint32_t b0, uint32_t b1, __nv_bfloat16) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma(float* c, const uint32_t* a, uint32_t b0, uint32_t b1, __half) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// Four 8x8 b16 matrices from shared memory (lanes 8i .. 8i + 7 give matrix i's row addresses); .trans transposes.
__device__ __forceinline__ void ldmatrix4(uint32_t* r, const void* p) {
    const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
__device__ __forceinline__ void ldmatrix4_trans(uint32_t* r, const void* p) {
    const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
// 16 bytes global -> shared without registers (zeros when !valid: nothing is read).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
    const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(a), "l"(src), "r"(valid ? 16 : 0));
}
"""

_SOURCE = """
    // Block (tile, kv head, split): queries tile * QT .. + QT of this kv head (query m is row m / G's head
    // kvh * G + m % G; with rows, batch row rows[m / G]) against the split's keys, KT at a time through shared
    // memory, double-buffered (the next tile is copied while this one is used). Warp w holds queries w * 16 .. + 16;
    // lane (gid = lane / 4, tid = lane % 4) holds query rows gid and gid + 8 of the warp's fragments: S columns
    // tid * 2, + 1 of each 8-key tile, O columns tid * 2, + 1 of each 8-dim tile.
    constexpr int QT = 16 * WARPS;
    constexpr int KP = D + 8;          // padded row of a shared tile, in elements: conflict-free ldmatrix
    constexpr int DS = D / 16;         // k-steps of S = Q K^T
    constexpr int NT = KT / 8;         // 8-key tiles of S
    constexpr int DT = D / 8;          // 8-dim tiles of O
    constexpr int CH = D / 8;          // 16-byte chunks of a key row
    __shared__ __align__(16) uint16_t ks[2][KT * KP];
    __shared__ __align__(16) uint16_t vs[2][KT * KP];
    const int lane = threadIdx.x & 31;
    const int w = threadIdx.x >> 5;
    const int gid = lane >> 2;
    const int tid = lane & 3;
    const int kvh = blockIdx.y;
    const int split = blockIdx.z;
    const int heads = k_shape[1] * G;
    const int r = HAS_ROWS ? rows_shape[0] : q_shape[0];
    const int M = r * G;
    const int P = k_shape[2];
    const int L = ((P + gridDim.z - 1) / gridDim.z + KT - 1) / KT * KT;
    const int k_begin = split * L;
    const int k_end = min(P, k_begin + L);
    const float sl2 = scale[0] * LOG2E;
    const T* kb = k + kvh * k_strides[1];
    const T* vb = v + kvh * v_strides[1];
    const bool vec = k_strides[3] == 1 && v_strides[3] == 1 && k_strides[2] % 8 == 0 && v_strides[2] % 8 == 0 &&
                     (reinterpret_cast<uintptr_t>(kb) & 15) == 0 && (reinterpret_cast<uintptr_t>(vb) & 15) == 0;

    // Tile kt's keys and values into buffer buf: cp.async where the rows are 16-byte aligned, else element by
    // element (then visible after the __syncthreads that precedes their use, as the async copies are).
    auto load = [&](int buf, int kt) {
        for (int i = threadIdx.x; i < KT * CH; i += WARPS * 32) {
            const int key = i / CH;
            const int c8 = (i % CH) * 8;
            const int j = kt + key;
            const bool valid = j < k_end;
            if (vec) {
                cp_async16(&ks[buf][key * KP + c8], valid ? kb + j * k_strides[2] + c8 : kb, valid);
                cp_async16(&vs[buf][key * KP + c8], valid ? vb + j * v_strides[2] + c8 : vb, valid);
            } else {
                for (int e = 0; e < 8; e++) {
                    const uint16_t* kx = reinterpret_cast<const uint16_t*>(kb);
                    const uint16_t* vx = reinterpret_cast<const uint16_t*>(vb);
                    ks[buf][key * KP + c8 + e] = valid ? kx[j * k_strides[2] + (c8 + e) * k_strides[3]] : 0;
                    vs[buf][key * KP + c8 + e] = valid ? vx[j * v_strides[2] + (c8 + e) * v_strides[3]] : 0;
                }
            }
        }
        asm volatile("cp.async.commit_group;");
    };
    if (k_begin < k_end) load(0, k_begin);

    uint32_t qa[DS][4];
    int qm[2];
    for (int h = 0; h < 2; h++) {
        const int m = blockIdx.x * QT + w * 16 + gid + h * 8;
        qm[h] = m;
        const T* qp = nullptr;
        if (m < M) {
            const int b = HAS_ROWS ? rows[m / G] : m / G;
            qp = q + b * q_strides[0] + (kvh * G + m % G) * q_strides[1];
        }
        for (int ds = 0; ds < DS; ds++) {
            for (int hi = 0; hi < 2; hi++) {
                const int c = ds * 16 + hi * 8 + tid * 2;
                const float x0 = qp ? static_cast<float>(qp[c * q_strides[3]]) : 0.f;
                const float x1 = qp ? static_cast<float>(qp[(c + 1) * q_strides[3]]) : 0.f;
                qa[ds][h + 2 * hi] = pack2(x0, x1, T());
            }
        }
    }

    float o[DT][4];
    for (int dt = 0; dt < DT; dt++) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.f;
    float mrow[2] = {NEG_INF, NEG_INF};
    float lrow[2] = {0.f, 0.f};
    // ldmatrix row addresses of this lane: K as S's B operand (two 8-key tiles by 16 dims), V^T as O's (16 keys
    // by two 8-dim tiles).
    const int k_row = (lane & 7) + (lane >> 4) * 8;
    const int k_col = ((lane >> 3) & 1) * 8;
    const int v_row = (lane & 7) + ((lane >> 3) & 1) * 8;
    const int v_col = (lane >> 4) * 8;
    for (int kt = k_begin, t = 0; kt < k_end; kt += KT, t++) {
        const int buf = t & 1;
        if (kt + KT < k_end) {
            load(buf ^ 1, kt + KT);
            asm volatile("cp.async.wait_group 1;");
        } else {
            asm volatile("cp.async.wait_group 0;");
        }
        __syncthreads();

        float s[NT][4];
        for (int nt = 0; nt < NT; nt++) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
        for (int ds = 0; ds < DS; ds++) {
            for (int nt = 0; nt < NT; nt += 2) {
                uint32_t b[4];
                ldmatrix4(b, &ks[buf][(nt * 8 + k_row) * KP + ds * 16 + k_col]);
                mma(s[nt], qa[ds], b[0], b[1], T());
                mma(s[nt + 1], qa[ds], b[2], b[3], T());
            }
        }
        float tile_max[2] = {NEG_INF, NEG_INF};
        for (int nt = 0; nt < NT; nt++) {
            for (int e = 0; e < 4; e++) {
                const int j = kt + nt * 8 + tid * 2 + (e & 1);
                const float x = j < k_end ? s[nt][e] * sl2 : NEG_INF;
                s[nt][e] = x;
                tile_max[e >> 1] = fmaxf(tile_max[e >> 1], x);
            }
        }
        float base[2];
        for (int h = 0; h < 2; h++) {
            tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 1));
            tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 2));
            const float m_new = fmaxf(mrow[h], tile_max[h]);
            base[h] = m_new == NEG_INF ? 0.f : m_new;
            const float f = exp2f(mrow[h] - base[h]);
            lrow[h] *= f;
            for (int dt = 0; dt < DT; dt++) {
                o[dt][2 * h] *= f;
                o[dt][2 * h + 1] *= f;
            }
            mrow[h] = m_new;
        }
        for (int nt = 0; nt < NT; nt++) {
            for (int e = 0; e < 4; e++) {
                const float p = exp2f(s[nt][e] - base[e >> 1]);
                s[nt][e] = p;
                lrow[e >> 1] += p;
            }
        }
        for (int j = 0; j < KT / 16; j++) {
            // S's accumulators of key tiles 2j, 2j + 1 are, packed, the A fragment of P's k-step j.
            const uint32_t pa[4] = {pack2(s[2 * j][0], s[2 * j][1], T()), pack2(s[2 * j][2], s[2 * j][3], T()),
                                    pack2(s[2 * j + 1][0], s[2 * j + 1][1], T()),
                                    pack2(s[2 * j + 1][2], s[2 * j + 1][3], T())};
            for (int dt = 0; dt < DT; dt += 2) {
                uint32_t b[4];
                ldmatrix4_trans(b, &vs[buf][(j * 16 + v_row) * KP + dt * 8 + v_col]);
                mma(o[dt], pa, b[0], b[1], T());
                mma(o[dt + 1], pa, b[2], b[3], T());
            }
        }
        __syncthreads();  // every warp is done with buf before the next iteration copies into it
    }

    for (int h = 0; h < 2; h++) {
        lrow[h] += __shfl_xor_sync(0xffffffffu, lrow[h], 1);
        lrow[h] += __shfl_xor_sync(0xffffffffu, lrow[h], 2);
        const int m = qm[h];
        if (m >= M) continue;
        const int head = (split * r + m / G) * heads + kvh * G + m % G;
        const float l = lrow[h];
        const float inv = l > 0.f ? 1.f / l : 0.f;
        for (int dt = 0; dt < DT; dt++) {
            *reinterpret_cast<float2*>(&o_part[head * D + dt * 8 + tid * 2]) =
                make_float2(o[dt][2 * h] * inv, o[dt][2 * h + 1] * inv);
        }
        if (tid == 0) lse_part[head] = l > 0.f ? mrow[h] * LN2 + logf(l) : NEG_INF;
    }
"""

_kernel: Any = None
_no_rows = None


def supported(dtype: Any, heads: int, kv_heads: int, dim: int) -> bool:
    """The shapes and dtypes the kernel takes: bf16/fp16, head sizes 64/96/128, whole groups of query heads."""
    return dtype in DTYPES and dim in HEAD_DIMS and heads % kv_heads == 0


def splits(queries: int, kv_heads: int, keys: int, min_split: int = MIN_SPLIT) -> int:
    """How many parts a level's keys are split into: enough blocks for the GPU, at least `min_split` keys each.

    A part is a whole number of key tiles (`part_length`), so no more parts than those that hold keys.
    """
    tiles = math.ceil(queries / (16 * _WARPS)) * kv_heads
    parts = max(1, min(math.ceil(TARGET_BLOCKS / tiles), math.ceil(keys / min_split)))
    return math.ceil(keys / part_length(keys, parts)) if keys else 1


def part_length(keys: int, parts: int) -> int:
    """Keys per part, whole key tiles (the kernel computes the same from its grid)."""
    return math.ceil(math.ceil(keys / parts) / KEY_TILE) * KEY_TILE


def prefix_decode(
    q: mx.array, keys: mx.array, values: mx.array, rows: mx.array | None, scale: float
) -> tuple[mx.array, mx.array]:
    """One decode step of a level's rows against its keys, in parts of the keys (CUDA).

    q: [B, H, 1, D] for the whole batch (bf16 or fp16); keys, values: [1, kv_heads, P, D] (any strides); rows:
    the batch rows of the level ([r] int32), None for all B. Returns o [S, r, H, D] float32 and lse [S, r, H]
    float32 for each of the S splits of the keys (lse -inf and o 0 for a split without keys), in the level's row
    order: cascade_decode._merge_splits makes them one (o, lse).
    """
    global _kernel, _no_rows
    if _kernel is None:
        _kernel = cuda_kernel(
            "omlx_cascade_prefix_decode",
            _compact(_SOURCE),
            _compact(_HEADER),
            input_names=["q", "k", "v", "rows", "scale"],
            output_names=["o_part", "lse_part"],
            ensure_row_contiguous=False,
        )
        _no_rows = mx.zeros((1,), dtype=mx.int32)
    batch, heads, _, dim = q.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    r = batch if rows is None else rows.shape[0]
    key = (q.dtype, heads, dim, kv_heads, length, r, rows is None, _WARPS, TARGET_BLOCKS, MIN_SPLIT)
    launch = _launches.get(key)
    if launch is None:  # once per shape: a decode step calls this once per layer and level
        if len(_launches) >= 1024:
            _launches.clear()
        launch = _launches[key] = _launch(q.dtype, heads, dim, kv_heads, length, r, rows is not None)
    if values.dtype != q.dtype or keys.dtype != q.dtype:
        keys, values = keys.astype(q.dtype), values.astype(q.dtype)
    if rows is not None and rows.dtype != mx.int32:
        rows = rows.astype(mx.int32)
    o, lse = _kernel(inputs=[q, keys, values, _no_rows if rows is None else rows, scale_array(scale)], **launch)
    return o, lse


_launches: dict[tuple[Any, ...], dict[str, Any]] = {}


def _launch(dtype: Any, heads: int, dim: int, kv_heads: int, length: int, r: int, has_rows: bool) -> dict[str, Any]:
    g = heads // kv_heads
    parts = splits(r * g, kv_heads, length)
    threads = 32 * _WARPS
    return {
        "template": [("T", dtype), ("D", dim), ("G", g), ("WARPS", _WARPS), ("KT", KEY_TILE), ("HAS_ROWS", has_rows)],
        "grid": (math.ceil(r * g / (16 * _WARPS)) * threads, kv_heads, parts),
        "threadgroup": (threads, 1, 1),
        "output_shapes": [(parts, r, heads, dim), (parts, r, heads)],
        "output_dtypes": [mx.float32, mx.float32],
    }


def _compact(source: str) -> str:
    """The source without comments and indentation: mlx 0.32.4 rebuilds a custom kernel's source on every call."""
    lines = (re.sub(r"\s*//.*$", "", line).strip() for line in source.splitlines())
    return "\n".join(line for line in lines if line)


def prefix_decode_reference(
    q: mx.array, keys: mx.array, values: mx.array, rows: mx.array | None, scale: float, min_split: int = MIN_SPLIT
) -> tuple[mx.array, mx.array]:
    """What prefix_decode computes, with mx ops (any device): the same splits of the keys (tests split shorter
    levels with a smaller `min_split`)."""
    if rows is not None:
        q = mx.take(q, rows, axis=0)
    r, heads, _, dim = q.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    parts = splits(r * (heads // kv_heads), kv_heads, length, min_split)
    step = part_length(length, parts)
    outs, lses = [], []
    for s in range(parts):
        lo, hi = min(s * step, length), min((s + 1) * step, length)
        if lo == hi:
            outs.append(mx.zeros((r, heads, dim), dtype=mx.float32))
            lses.append(mx.full((r, heads), NEG_INF, dtype=mx.float32))
            continue
        k, v = keys[:, :, lo:hi], values[:, :, lo:hi]
        o, lse = attend(q, mx.broadcast_to(k, (r, *k.shape[1:])), mx.broadcast_to(v, (r, *v.shape[1:])), scale)
        outs.append(o[:, :, 0])
        lses.append(lse[:, :, 0])
    return mx.stack(outs), mx.stack(lses)
