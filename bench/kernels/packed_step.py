"""Benchmark and check: a decode step's prefix levels in one packed call against one call per level, and copies.

1. Correctness on this device: cascade.attention with the routing's kernels (CUDA: the suffix kernel, the prefix
   kernel for the per-level path), packed and per level, against attention over each row's concatenated keys
   (tests/cascade_cases.py), fp32 and bf16.
2. One layer's decode attention, stacked as a step runs its layers, for G groups of R rows over P-token levels:
   per level, packed, and the levels copied into the rows (no level: what cascade off reads). Side by side.
3. The cost model's device costs as calibrate.py measures them at start-up for this shape.

    .venv/bin/python bench/kernels/packed_step.py --heads 4 --kv-heads 2 --dim 64 --groups 4 --rows 4   # CPU
    python3 bench/kernels/packed_step.py          # H200: Qwen3-8B's attention shape, 8 groups x 16 rows x 300
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.lib.steps import stacked_ms  # (the worker package loads a fast BLAS before mlx)
from omlx_jobs.defaults import Switches
from omlx_jobs.worker.attention import calibrate, cascade, routing
from omlx_jobs.worker.attention import packed as packing
from omlx_jobs.worker.attention.kernels import ragged
from omlx_jobs.worker.attention.parts import Level


def check(options: object, heads: int, kv_heads: int, dim: int) -> None:
    import mlx.core as mx

    from tests.cascade_cases import case

    for dtype in (mx.float32, mx.bfloat16):
        q, k, v, levels, mask, start, ref = case(heads=heads, kv_heads=kv_heads, dim=dim, n=1, dtype=dtype)
        for packed in ("always", "never"):
            opts = dataclasses.replace(options, packed=packed)  # type: ignore[type-var]
            out = cascade.attention(q, k, v, levels, dim**-0.5, mask, start, (k, v), opts)
            err = mx.abs(out.astype(mx.float32) - ref).max().item()
            print(f"check {dtype} packed={packed}: max error {err:.2e}", flush=True)


def batch(groups: int, rows: int, length: int, own: int, kv_heads: int, dim: int, dtype: object) -> tuple:
    import mlx.core as mx

    b = groups * rows
    levels = []
    for g in range(groups):
        member = (mx.arange(b) // rows) == g
        slot = mx.array([i % rows for i in range(b)], mx.int32)
        keys = mx.random.normal((1, kv_heads, length, dim)).astype(dtype)
        vals = mx.random.normal((1, kv_heads, length, dim)).astype(dtype)
        levels.append(Level(keys, vals, mx.arange(g * rows, (g + 1) * rows, dtype=mx.int32), slot, member))
    return b, levels


def layer_call(q: Any, k: Any, v: Any, lv: list[Level], mask: Any, start: Any, opts: Any, packed: Any) -> Any:
    """One layer's decode attention: cascade with levels, else what a batch without levels runs."""
    import mlx.core as mx

    if lv:
        return lambda: cascade.attention(q, k, v, lv, 0.088, mask, start, (k, v), opts, packed=packed)
    if ragged.available():
        return lambda: ragged.ragged_decode(q, k, v, start, 0.088)
    return lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=0.088, mask=mask)


def main() -> None:
    import mlx.core as mx

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--rows", type=int, default=16, help="rows per group")
    ap.add_argument("--length", type=int, default=300, help="tokens per group's level")
    ap.add_argument("--own", type=int, default=160, help="own tokens per row")
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    gpu = mx.default_device() != mx.cpu
    dtype = mx.bfloat16 if gpu else mx.float32
    base = routing.for_backend(Switches(), kernels=ragged.available()).cascade
    print(f"device {mx.default_device()}; kernels {ragged.available()}; dtype {dtype}", flush=True)
    check(base, args.heads, args.kv_heads, args.dim)
    b, levels = batch(args.groups, args.rows, args.length, args.own, args.kv_heads, args.dim, dtype)
    q = mx.random.normal((b, args.heads, 1, args.dim)).astype(dtype)
    results = {}
    for name, own, lv in (
        ("per-level", args.own, levels),
        ("packed", args.own, levels),
        ("copied", args.own + args.length, []),
    ):
        k = mx.random.normal((b, args.kv_heads, own, args.dim)).astype(dtype)
        v = mx.random.normal((b, args.kv_heads, own, args.dim)).astype(dtype)
        start, mask = mx.zeros((b,), mx.int32), mx.ones((b, 1, 1, own), mx.bool_)
        opts = dataclasses.replace(base, packed="always" if name == "packed" else "never")
        packed = packing.pack(lv, b) if name == "packed" else None
        mx.eval(k, v)
        fn = layer_call(q, k, v, lv, mask, start, opts, packed)
        results[name] = stacked_ms(fn, args.layers, args.iters)[0]
    shape = f"{args.groups} groups x {args.rows} rows x {args.length} tokens, {args.own} own"
    print(f"one layer's decode attention, ms ({shape}): " + "  ".join(f"{k} {v:.4f}" for k, v in results.items()))
    print(
        f"per-level / packed {results['per-level'] / results['packed']:.2f}; copied / packed "
        f"{results['copied'] / results['packed']:.2f}"
    )
    for rows in sorted({64, 128, b}):
        costs = calibrate.measure(base, heads=args.heads, kv_heads=args.kv_heads, dim=args.dim, dtype=dtype, batch=rows)
        print(f"calibrate batch {rows}: {costs}", flush=True)


if __name__ == "__main__":
    main()
