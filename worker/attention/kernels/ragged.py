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

from typing import Any

import mlx.core as mx

from omlx_jobs.worker.attention.kernels.cuda import DECODE_HEADER, cuda_kernel, decode_source, scale_array

HEAD_DIMS = frozenset({64, 96, 128, 256})
_WARPS = 8  # 256 threads: room for 255 registers each (the G query heads are kept in registers)

SOURCE = decode_source(
    """
    // One block per (row, kv head); its G query heads share each key and value load. WARPS warps take every
    // WARPS-th key from the row's first real key on, with an online softmax; then the warps' partial results
    // are combined in shared memory."""
)

_kernel: Any = None


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


def ragged_decode(q: mx.array, k: mx.array, v: mx.array, start: mx.array, scale: float) -> mx.array:
    """softmax(q k^T * scale) v for one query per row, row b attending to keys start[b]: (CUDA kernel).

    q: [B, heads, 1, D]; k, v: [B, kv_heads, L, D] (any strides); start: [B] int32.
    """
    global _kernel
    if _kernel is None:
        _kernel = cuda_kernel(
            "omlx_ragged_decode",
            SOURCE,
            DECODE_HEADER,
            input_names=["q", "k", "v", "start", "scale"],
            output_names=["out"],
            ensure_row_contiguous=False,
        )
    batch, heads, _, dim = q.shape
    kv_heads = k.shape[1]
    if start.dtype != mx.int32:
        start = start.astype(mx.int32)
    (out,) = _kernel(
        inputs=[q, k, v, start, scale_array(scale)],
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
