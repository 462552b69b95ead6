"""Where a decode step's time goes: the model's step, its attention and its matmuls, by batch and context.

Decoding is most of a job's wall time once prefixes are reused (bench/RESULTS.md), so this measures one
decode step of mlx-lm's batched KV cache in isolation, side by side in one run:

  step     the whole model, one token for each of B rows holding L cached tokens (BatchKVCache, as
           BatchGenerator decodes): with the array mask mlx-lm builds; with omlx-jobs' ragged decode
           kernel (CUDA only, worker/attention.py); with no mask at all (wrong for padded rows: a floor)
  sdpa     one layer's attention alone: mx.fast with no mask / a bool mask, and the ragged kernel
  err      the ragged kernel's largest difference from masked mx.fast attention on ragged rows
  matmul   one [B, hidden] x [hidden, intermediate] projection

    python3 bench/kernels/decode_step.py --model random:qwen3-8b --dtype bfloat16     # on a GPU
    .venv/bin/python bench/kernels/decode_step.py --model tiny --quick
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.lib.models import load_bench_model
from bench.lib.steps import timed
from omlx_jobs.worker.attention import routing
from omlx_jobs.worker.attention.kernels import ragged as attention  # the worker package loads a fast BLAS before mlx
from omlx_jobs.worker.attention.options import Routing


def batch_caches(model: Any, b: int, length: int, dtype: Any, padded: bool) -> list[Any]:
    """Per-layer BatchKVCache for b rows holding `length` tokens of random keys and values."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    args = model.args
    heads, dim = args.num_key_value_heads, args.head_dim
    room = (length + 256 + 255) // 256 * 256
    pad = [1 if padded and i == 0 else 0 for i in range(b)]
    caches = []
    for _ in model.layers:
        c = BatchKVCache(pad)
        c.keys = (mx.random.normal((b, heads, room, dim)) * 0.5).astype(dtype)
        c.values = (mx.random.normal((b, heads, room, dim)) * 0.5).astype(dtype)
        c.offset = mx.array([length - p for p in pad])
        c._idx = length
        caches.append(c)
    mx.eval([c.state for c in caches])
    return caches


def step_ms(model: Any, b: int, length: int, dtype: Any, mode: str, iters: int) -> float:
    """mode: mask (mlx-lm as is), ragged (our kernel), none (no mask, rows unpadded)."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    if mode == "ragged" and not (attention.available() and routing.install(model)):
        return float("nan")
    mask = mode != "none"
    caches = batch_caches(model, b, length, dtype, padded=mask)
    tokens = mx.array([[7]] * b)
    start = [c._idx for c in caches]
    original = BatchKVCache.make_mask

    def run() -> Any:
        for c, s in zip(caches, start, strict=True):  # every step decodes at the same context length
            c._idx = s
        return model(tokens, cache=caches)

    if not mask:
        BatchKVCache.make_mask = lambda self, n, **kw: None if n == 1 else original(self, n, **kw)
    try:
        with routing.active(Routing(ragged=attention.ragged_decode)) if mode == "ragged" else contextlib.nullcontext():
            return timed(run, iters)
    finally:
        BatchKVCache.make_mask = original
        mx.clear_cache()


def sdpa_ms(b: int, length: int, heads: int, kv_heads: int, dim: int, dtype: Any, iters: int) -> list[float]:
    """[ms with no mask, ms with a bool mask, ms of the ragged kernel, kernel's max abs error]."""
    import mlx.core as mx

    q = mx.random.normal((b, heads, 1, dim)).astype(dtype)
    room = (length + 255) // 256 * 256 + 256
    k = mx.random.normal((b, kv_heads, room, dim)).astype(dtype)[..., :length, :]  # a slice, as the cache is
    v = mx.random.normal((b, kv_heads, room, dim)).astype(dtype)[..., :length, :]
    start = mx.array([(i * 37) % max(1, length // 2) for i in range(b)], dtype=mx.int32)
    m = (mx.arange(length)[None] >= start[:, None])[:, None, None, :]
    mx.eval(q, k, v, m, start)
    scale = dim**-0.5
    out = [
        timed(lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale), iters),
        timed(lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=m), iters),
    ]
    if not attention.available():
        return out + [float("nan")] * 2
    ref = attention.ragged_reference(q, k, v, start, scale).astype(mx.float32)
    err = mx.abs(attention.ragged_decode(q, k, v, start, scale).astype(mx.float32) - ref).max().item()
    return out + [timed(lambda: attention.ragged_decode(q, k, v, start, scale), iters), err]


def matmul_ms(b: int, n_in: int, n_out: int, dtype: Any, iters: int) -> float:
    import mlx.core as mx

    x = mx.random.normal((b, n_in)).astype(dtype)
    w = (mx.random.normal((n_out, n_in)) * 0.02).astype(dtype)
    mx.eval(x, w)
    return timed(lambda: x @ w.T, iters)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="tiny | PATH | gguf:FILE | random:qwen3-8b ...")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--batches", default="1,8,32,64,128")
    ap.add_argument("--contexts", default="64,1056")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="batches 1,8; contexts 16,128; 5 iterations")
    args = ap.parse_args()
    if args.quick:
        args.batches, args.contexts, args.iters = "1,8", "16,128", 5

    import mlx.core as mx

    loaded = load_bench_model(args.model, dtype=args.dtype)
    model = loaded.model
    a = model.args
    dtype = model.layers[0].self_attn.q_proj.weight.dtype
    batches = [int(x) for x in args.batches.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    print(f"model {args.model} ({dtype}); device {mx.default_device()}; ms per call, {args.iters} calls each")
    if attention.available():
        for dim in sorted(attention.HEAD_DIMS):
            err = sdpa_ms(5, 300, 8, 2, dim, dtype, 1)[3]
            print(f"ragged kernel, head dim {dim}: max abs error vs masked mx.fast attention {err:.5f}")
    print(
        f"{'B':>4} {'L':>5} | {'step mask':>9} {'ragged':>7} {'none':>7} | {'sdpa none':>9} {'bool':>7} "
        f"{'ragged':>7} {'err':>8} | {'matmul':>7} | {'tok/s mask':>10} {'ragged':>7}"
    )
    for b in batches:
        mm = matmul_ms(b, a.hidden_size, a.intermediate_size, dtype, args.iters)
        for length in contexts:
            steps = [step_ms(model, b, length, dtype, mode, args.iters) for mode in ("mask", "ragged", "none")]
            s = sdpa_ms(b, length, a.num_attention_heads, a.num_key_value_heads, a.head_dim, dtype, args.iters)
            print(
                f"{b:4d} {length:5d} | {steps[0]:9.2f} {steps[1]:7.2f} {steps[2]:7.2f} | {s[0]:9.3f} {s[1]:7.3f} "
                f"{s[2]:7.3f} {s[3]:8.5f} | {mm:7.3f} | {b / steps[0] * 1000:10.0f} {b / steps[1] * 1000:7.0f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
