"""Benchmark: one layer's prefill attention on the CPU, mlx's (every key) against worker/cpu_prefill.py (blocks).

Side by side in one run, best of --repeat, for a prefill of N queries at the end of a cache of N + offset keys,
with BatchKVCache's boolean mask; the maximum difference of the outputs is printed too. "poly" is the same
blocks exponentiated with the decode steps' base-2 polynomial (cascade._exp2) instead of power(2, x). Then one
decode step's attention of --decode-rows rows to a shared prefix of --decode-keys keys (cascade.softmax_v, the
rows' queries folded together), with power(2, x) and with the polynomial.

    .venv/bin/python bench/kernels/cpu_prefill.py                      # SmolLM2's shape: 9 heads, 3 kv heads, D 64
    .venv/bin/python bench/kernels/cpu_prefill.py --heads 32 --kv-heads 8 --dim 128 --n 1024
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import omlx_jobs.worker  # noqa: F401  (a fast BLAS before mlx)


def best_ms(fn: Callable[[], Any], repeat: int) -> float:
    import mlx.core as mx

    mx.eval(fn())
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t)
    return min(times) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--n", default="2000,512", help="query counts (prefill chunk lengths)")
    ap.add_argument("--offset", default="0,1536", help="keys already cached before each chunk, one per --n")
    ap.add_argument("--blocks", default="64,128,256,512", help="query block sizes to time")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--decode-rows", type=int, default=64)
    ap.add_argument("--decode-keys", type=int, default=2000)
    args = ap.parse_args()

    import mlx.core as mx
    from mlx_lm.models.base import create_causal_mask

    mx.set_default_device(mx.cpu)
    scale = args.dim**-0.5
    print(f"one layer, {args.heads} heads, {args.kv_heads} kv heads, D {args.dim}; ms, best of {args.repeat}")
    for n, offset in zip(map(int, args.n.split(",")), map(int, args.offset.split(",")), strict=True):
        q = mx.random.normal((1, args.heads, n, args.dim))
        k = mx.random.normal((1, args.kv_heads, n + offset, args.dim))
        v = mx.random.normal((1, args.kv_heads, n + offset, args.dim))
        mask = create_causal_mask(n, offset, left_padding=mx.array([0]))
        mx.eval(q, k, v, mask)
        print(f"N {n} after {offset}: " + row((q, k, v, mask), scale, args), flush=True)
    from omlx_jobs.worker.attention import parts as cascade

    g = args.heads // args.kv_heads
    q = mx.random.normal((1, args.kv_heads, args.decode_rows * g, args.dim))
    k = mx.random.normal((1, args.kv_heads, args.decode_keys, args.dim))
    v = mx.random.normal((1, args.kv_heads, args.decode_keys, args.dim))
    mx.eval(q, k, v)
    power = best_ms(lambda: cascade.softmax_v(q, k, v, None, scale), args.repeat)
    poly = best_ms(lambda: cascade.softmax_v(q, k, v, None, scale, base2=True), args.repeat)
    print(f"decode, {args.decode_rows} rows x {args.decode_keys} prefix keys: power {power:.2f}, poly {poly:.2f}")


def row(inputs: tuple[Any, ...], scale: float, args: argparse.Namespace) -> str:
    """mlx's attention, then each block size with power(2, x) and with the polynomial; the outputs' difference."""
    import mlx.core as mx

    from omlx_jobs.worker.attention import cpu_prefill
    from omlx_jobs.worker.attention import parts as cascade

    q, k, v, mask = inputs
    theirs = best_ms(lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask), args.repeat)
    cells = [f"mlx {theirs:.1f}"]
    for block in map(int, args.blocks.split(",")):
        ours = best_ms(lambda b=block: cpu_prefill.attention(q, k, v, scale, mask, block=b), args.repeat)
        power, cascade._exp = cascade._exp, lambda x: cascade._exp2(x * cascade.LOG2E)
        try:
            poly = best_ms(lambda b=block: cpu_prefill.attention(q, k, v, scale, mask, block=b), args.repeat)
        finally:
            cascade._exp = power
        cells.append(f"blocks of {block}: {ours:.1f} ({theirs / ours:.2f}x), poly {poly:.1f}")
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    err = mx.abs(cpu_prefill.attention(q, k, v, scale, mask, block=block) - want).max().item()
    return "; ".join(cells) + f"; max difference {err:.1e}"


if __name__ == "__main__":
    main()
