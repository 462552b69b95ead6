"""One decode step over a shared prefix: today's path (every row holds a copy) against cascade attention.

Side by side in one run, for each row count R (a shared prefix of P tokens plus O own tokens per row):

  today P+O   BatchKVCache, each row holding P+O tokens: the ragged kernel on CUDA (worker/attention.py),
              mlx-lm's masked attention elsewhere
  today S     the same at S tokens (default 128): the goal is cascade at P shared <= 1.3x this
  cascade     CascadeKVCache (worker/cascade_cache.py): one copy of the prefix, O own tokens per row;
              mx ops ("mx", compiled on GPUs; "eager": op by op), on CUDA with the suffix kernel
              ("kernel", worker/cascade_kernel.py; the prefix levels in mx ops), with the suffix kernel and the
              tensor-core prefix kernel ("prefix", worker/cascade_prefix.py; the default on CUDA), and on GPUs
              through mlx's fused attention with the rows along the query axis ("fused", worker/cascade_fused.py:
              cuDNN on CUDA; opt-in)
  admit       admitting requests that share the prefix: today each gets a copy of it, cascade references it
  check       (CUDA) the cascade kernels against their mx-ops references, and cascade attention against
              mx.fast attention over each row's concatenated keys, head sizes 64/96/128/256, fp32, bf16, fp16;
              then the prefix kernel's part of a layer by warps per block and blocks aimed at ("tune")
  floor       where a small-context step goes: Python graph construction vs evaluation, graph nodes per
              step, the weights' matmuls alone, and an mx.compile'd fixed-shape decode step vs uncompiled

    python3 bench/kernels/cascade_step.py --model random:qwen3-8b --dtype bfloat16            # H200, about 3-5 min
    .venv/bin/python bench/kernels/cascade_step.py --model tiny --quick                       # smoke test
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.lib.models import load_bench_model
from bench.lib.steps import floor, graph_nodes, own_caches, random_array, stacked_ms, timed
from omlx_jobs.defaults import Switches
from omlx_jobs.worker.attention import cascade, cascade_decode, routing
from omlx_jobs.worker.attention import fused as cascade_fused
from omlx_jobs.worker.attention.kernels import prefix as cascade_prefix
from omlx_jobs.worker.attention.kernels import ragged as attention  # the worker package loads a fast BLAS first
from omlx_jobs.worker.attention.kernels import suffix as cascade_kernel
from omlx_jobs.worker.attention.options import CascadeOptions, Routing
from omlx_jobs.worker.attention.parts import Level, merge
from omlx_jobs.worker.backend.cascade_cache import CascadeKVCache, Segment


def cascade_caches(model: Any, rows: int, prefix: int, own: int, dtype: Any) -> list[Any]:
    """Per-layer CascadeKVCache: one shared prefix level of `prefix` tokens, then `own` tokens per row."""
    import mlx.core as mx

    a = model.args
    out = []
    for c in own_caches(model, rows, own, dtype):
        shape = (1, a.num_key_value_heads, prefix, a.head_dim)
        seg = Segment(random_array(shape, dtype), random_array(shape, dtype), 0)
        mx.eval(seg.keys, seg.values)
        out.append(CascadeKVCache([(seg,)] * rows, c))
    return out


def step_ms(model: Any, caches: list[Any], iters: int, route: Any = None) -> tuple[float, float, int]:
    """One decode step of every row at a fixed context (the caches are rewound after each step).

    Returns ms per step, of that the ms of Python building the step's graph (before mx.eval runs it), and the
    number of nodes in a step's graph (a compiled function counts as one).
    """
    import mlx.core as mx

    owns = [getattr(c, "own", c) for c in caches]
    start = [c._idx for c in owns]
    tokens = mx.array([[7]] * int(owns[0].offset.shape[0]))
    build: list[float] = []

    def run() -> Any:
        t0 = time.perf_counter()
        for c, s in zip(owns, start, strict=True):
            c._idx = s
        out = model(tokens, cache=caches)
        build.append(time.perf_counter() - t0)
        return out

    try:
        with route if route is not None else contextlib.nullcontext():
            ms = timed(run, iters)
            probe = run()
            nodes = graph_nodes(probe)
            mx.eval(probe)
    finally:  # a step that failed half way must not leave its layers at different lengths for the next mode
        for c, s in zip(owns, start, strict=True):
            c._idx = s
    return ms, sum(build[-iters - 1 : -1]) / iters * 1000, sum(nodes.values())


OPTIONS = CascadeOptions()
"""The options (and compiled graphs) of the parts timed on their own."""


def kernel_options(prefix: bool) -> CascadeOptions:
    """Cascade options with the CUDA kernels: the suffix kernel, and the prefix kernel if `prefix`."""
    return routing.for_backend(Switches(cascade_prefix_kernel=prefix), kernels=True).cascade


def route(mode: str, cuda: bool) -> Any:
    """The attention routing of a mode: ragged (today on CUDA), kernel (cascade's suffix kernel, prefix in mx ops),
    prefix (both cascade kernels), eager (cascade uncompiled), fused (cascade_fused.decode: mlx's fused attention,
    the rows along the query axis); the other modes with the fused decode off."""
    switches = Switches(
        cascade_fused_decode=mode == "fused",
        cascade_prefix_kernel=mode == "prefix",
        cascade_compile="never" if mode == "eager" else "auto",
    )
    chosen = routing.for_backend(switches, kernels=mode in ("kernel", "prefix"))
    chosen = dataclasses.replace(chosen, ragged=attention.ragged_decode if mode == "ragged" and cuda else None)
    return routing.active(chosen)


def compare(model: Any, rows: int, args: argparse.Namespace, dtype: Any, cuda: bool, gpu: bool) -> dict[str, float]:
    """Median step times of today's path (small and full context) and cascade (mx ops, CUDA kernel), interleaved."""
    import statistics

    import mlx.core as mx

    shared = cascade_caches(model, rows, args.prefix, args.own, dtype)
    runs = [
        ("today_small", own_caches(model, rows, args.small, dtype), "ragged"),
        ("today_full", own_caches(model, rows, args.prefix + args.own, dtype), "ragged"),
        ("cascade_mx", shared, "mx"),
    ]
    if gpu:
        runs.append(("cascade_eager", shared, "eager"))
    if cuda:
        runs.append(("cascade_kernel", shared, "kernel"))
        runs.append(("cascade_prefix", shared, "prefix"))
    if gpu:
        runs.append(("cascade_fused", shared, "fused"))
    times: dict[str, list[float]] = {name: [] for name, _, _ in runs}
    builds: dict[str, list[float]] = {name: [] for name, _, _ in runs}
    nodes: dict[str, int] = {}
    failed: set[str] = set()
    for _ in range(args.repeat):  # old and new interleaved: the machine's noise hits all of them alike
        for name, caches, mode in runs:
            if name in failed:
                continue
            try:
                ms, build, nodes[name] = step_ms(model, caches, args.iters, route(mode, cuda))
            except Exception as exc:  # a kernel that does not build must not cost the other figures
                print(f"     {name} failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                failed.add(name)
                continue
            times[name].append(ms)
            builds[name].append(build)
    layer = layer_ms(model, runs[1][1][0], shared[0], args.iters, cuda and "cascade_kernel" not in failed)
    del runs, shared
    mx.clear_cache()
    nan = float("nan")
    out = {name: statistics.median(ts) if ts else nan for name, ts in times.items()} | layer
    out |= {f"{name}_build": statistics.median(ts) for name, ts in builds.items() if ts}
    out |= {f"{name}_nodes": n for name, n in nodes.items()}
    out.setdefault("cascade_kernel", float("nan"))
    out.setdefault("cascade_prefix", float("nan"))
    out.setdefault("cascade_eager", float("nan"))
    out.setdefault("cascade_fused", float("nan"))
    return out


def layer_ms(model: Any, full: Any, shared: Any, iters: int, cuda: bool) -> dict[str, float]:
    """One layer's decode attention alone, each call evaluated: today's (every row's copy), cascade's, its parts."""
    import mlx.core as mx

    a = model.args
    rows = int(full.offset.shape[0])
    q = random_array((rows, a.num_attention_heads, 1, a.head_dim), full.keys.dtype)
    scale = a.head_dim**-0.5
    k, v = full.keys[..., : full._idx, :], full.values[..., : full._idx, :]
    mask = (mx.arange(full._idx)[None] >= full.left_padding[:, None])[:, None, None, :]
    own = shared.own
    ok, ov = own.keys[..., : own._idx, :], own.values[..., : own._idx, :]
    own_mask = (mx.arange(own._idx)[None] >= own.left_padding[:, None])[:, None, None, :]
    levels, _ = shared.cascade_layout()
    mx.eval(q, mask, own_mask)
    structure = tuple(lv.rows is not None for lv in levels)
    kv_heads = a.num_key_value_heads
    sizes = cascade_decode.batch_sizes(rows, levels)
    prefix_part = cascade_decode._decode_step(
        kv_heads, a.num_attention_heads // kv_heads, scale, structure, False, sizes, OPTIONS
    )
    flat = [x for lv in levels for x in (lv.keys, lv.values, lv.rows, lv.slot, lv.member) if x is not None]
    if cuda:
        today = timed(lambda: attention.ragged_decode(q, k, v, full.left_padding, scale), iters)
    else:
        today = timed(lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask), iters)
    out = {
        "layer_today": today,
        "layer_mx": timed(lambda: cascade.attention(q, ok, ov, levels, scale, own_mask, own.left_padding), iters),
        "layer_prefix": timed(lambda: prefix_part(q, *flat), iters),
        "layer_kernel": float("nan"),
        "layer_prefix_kernel": float("nan"),
        "layer_both": float("nan"),
        "layer_fused": timed(
            lambda: cascade_fused.decode(q, own.keys, own.values, own._idx, own.left_padding, levels, scale), iters
        ),
    }
    # The same, as a step runs them: one call per layer, the model's layers evaluated at once (per layer, ms).
    layers = len(model.layers)

    def stacked(fn: Any) -> tuple[float, float]:
        return stacked_ms(fn, layers, max(2, iters // 4))

    out["stack_prefix"] = stacked(lambda: prefix_part(q, *flat))
    for name in ("stack_today", "stack_kernel", "stack_prefix_kernel", "stack_both"):
        out[name] = (float("nan"), float("nan"))
    if cuda:
        out["stack_today"] = stacked(lambda: attention.ragged_decode(q, k, v, full.left_padding, scale))
        whole = lambda: cascade.attention(q, ok, ov, levels, scale, own_mask, own.left_padding)  # noqa: E731
        with routing.active(Routing(cascade=kernel_options(False))):
            out["layer_kernel"] = timed(whole, iters)
            out["stack_kernel"] = stacked(whole)
        if cascade_decode.prefix_supported(q.dtype, a.num_attention_heads, kv_heads, a.head_dim):
            part = lambda: cascade_decode._prefix_levels(q, levels, scale, cascade_prefix.prefix_decode, OPTIONS)  # noqa: E731
            out["layer_prefix_kernel"] = timed(part, iters)
            out["stack_prefix_kernel"] = stacked(part)
            with routing.active(Routing(cascade=kernel_options(True))):
                out["layer_both"] = timed(whole, iters)
                out["stack_both"] = stacked(whole)
    return out


def admit_ms(model: Any, rows: int, prefix: int, suffix: int, dtype: Any, iters: int) -> tuple[float, float]:
    """Admitting `rows` requests that share a prefix: batch their caches and prefill their suffixes.

    Today each row gets a copy of the prefix (mlx-lm's merge of KVCache views); cascade references it.
    """
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache, KVCache

    from omlx_jobs.worker.backend.cascade_cache import SharedPrefix, row_caches

    a = model.args
    entry = []
    for _ in model.layers:
        c = KVCache()
        shape = (1, a.num_key_value_heads, prefix, a.head_dim)
        c.keys, c.values, c.offset = random_array(shape, dtype), random_array(shape, dtype), prefix
        mx.eval(c.keys, c.values)
        entry.append(c)
    level = SharedPrefix.from_caches(entry, 0, prefix)
    tokens = mx.array([[7] * suffix] * rows)

    def today() -> Any:
        batch = [BatchKVCache.merge([c] * rows) for c in entry]
        return model(tokens, cache=batch), [c.state for c in batch]

    def ours() -> Any:
        per_row = [row_caches([level], len(entry)) for _ in range(rows)]
        batch = [CascadeKVCache.merge([r[i] for r in per_row]) for i in range(len(entry))]
        return model(tokens, cache=batch), [c.state for c in batch]

    return timed(today, iters), timed(ours, iters)


def check_kernel() -> None:
    """The cascade kernel against its mx-ops reference and the whole cascade against sdpa, on ragged rows."""
    import importlib.util

    import mlx.core as mx

    # By path: a `tests` package elsewhere on sys.path (some wheels ship one) must not shadow ours.
    path = Path(__file__).resolve().parents[2] / "tests" / "cascade_cases.py"
    spec = importlib.util.spec_from_file_location("cascade_cases", path)
    assert spec is not None and spec.loader is not None
    cases = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cases)
    case = cases.case
    nan = float("nan")
    for dtype in (mx.float32, mx.bfloat16, mx.float16):
        for dim in (64, 96, 128, 256):
            for heads, kv_heads in ((32, 8), (8, 8)):
                q, k, v, levels, mask, start, ref = case(heads=heads, kv_heads=kv_heads, dim=dim, n=1, dtype=dtype)
                scale = dim**-0.5
                portable = cascade.attention(q, k, v, levels, scale, mask, start).astype(mx.float32)
                errors = [mx.abs(portable - ref).max().item(), nan, nan]
                try:
                    o, lse = merge([cascade.attend_level(q, lv, scale) for lv in levels])
                    kern = cascade_kernel.suffix_decode(q, k, v, start, o, lse, scale).astype(mx.float32)
                    want = cascade_kernel.suffix_decode_reference(q, k, v, start, o, lse, scale).astype(mx.float32)
                    whole = cascade.attention(q, k, v, levels, scale, mask, start, options=kernel_options(False))
                    whole = whole.astype(mx.float32)
                    errors[1:] = [mx.abs(kern - want).max().item(), mx.abs(whole - ref).max().item()]
                    fused = cascade_fused.decode(q, k, v, k.shape[2], start, levels, scale).astype(mx.float32)
                    errors.append(mx.abs(fused - ref).max().item())
                    both = cascade.attention(q, k, v, levels, scale, mask, start, options=kernel_options(True))
                    both = both.astype(mx.float32)
                    errors.append(mx.abs(both - ref).max().item())
                except Exception as exc:  # report it and go on: the mx path's figures still count
                    print(f"check: the kernel failed: {type(exc).__name__}: {str(exc)[:500]}", flush=True)
                print(
                    f"check {str(dtype).split('.')[-1]:>8} D={dim:3d} H={heads:2d} kvH={kv_heads}: vs sdpa over the "
                    f"concatenation: mx path {errors[0]:.2e}, kernel path {errors[2]:.2e}, fused decode "
                    f"{errors[3] if len(errors) > 3 else nan:.2e}, both kernels "
                    f"{errors[4] if len(errors) > 4 else nan:.2e}"
                    f"{'' if cascade_decode.prefix_supported(dtype, heads, kv_heads, dim) else ' (prefix in mx ops)'}; "
                    f"kernel vs its reference {errors[1]:.2e}",
                    flush=True,
                )
    check_one_level(case)


def check_one_level(case: Any) -> None:
    """One level that every row continues (the common job): its parts go to the suffix kernel unmerged."""
    import mlx.core as mx

    for dtype in (mx.bfloat16, mx.float16):
        for dim in (64, 128):
            for heads, kv_heads in ((32, 8), (8, 8)):
                q, k, v, levels, mask, start, ref = case(
                    heads=heads, kv_heads=kv_heads, dim=dim, n=1, dtype=dtype, chains=[[0]] * 8, segments=[1500]
                )
                try:
                    both = cascade.attention(q, k, v, levels, dim**-0.5, mask, start, options=kernel_options(True))
                    both = both.astype(mx.float32)
                    err = mx.abs(both - ref).max().item()
                except Exception as exc:
                    print(f"check one level: failed: {type(exc).__name__}: {str(exc)[:800]}", flush=True)
                    return
                parts = cascade_prefix.splits(8 * heads // kv_heads, kv_heads, 1500)
                print(
                    f"check one level of 1500 tokens for 8 rows {str(dtype).split('.')[-1]:>8} D={dim:3d} H={heads:2d} "
                    f"kvH={kv_heads}, {parts} parts into the suffix kernel: both kernels vs sdpa {err:.2e}",
                    flush=True,
                )


def check_prefix_kernel() -> None:
    """The prefix kernel against its mx-ops reference, split by split: all rows or a subset, lengths off the key
    tile, keys that are views into longer buffers (strided, offset), as the engine's levels are, or whose rows are
    not 16-byte aligned (with the subsets)."""
    import mlx.core as mx

    mx.random.seed(3)
    shapes = [(128, 32, 8, 3072, False), (7, 32, 8, 1000, True), (3, 8, 8, 37, False), (33, 16, 2, 517, True)]
    for dtype in (mx.bfloat16, mx.float16):
        for dim in (64, 96, 128):
            for batch, heads, kv_heads, length, subset in shapes:
                q = random_array((batch, heads, 1, dim), dtype)
                if subset:  # rows 2 bytes past 16-byte alignment: the kernel's element-by-element loads
                    buffers = [random_array((1, kv_heads, length + 40, dim + 1), dtype) for _ in range(2)]
                    keys, values = (b[:, :, 3 : 3 + length, :dim] for b in buffers)
                else:  # views into longer buffers, as the engine's levels are (16-byte aligned rows)
                    buffers = [random_array((1, kv_heads, length + 40, dim), dtype) for _ in range(2)]
                    keys, values = (b[:, :, 3 : 3 + length] for b in buffers)
                rows = mx.array(list(range(1, batch, 2)), mx.int32) if subset else None
                scale = dim**-0.5
                try:
                    o, lse = cascade_prefix.prefix_decode(q, keys, values, rows, scale)
                    want_o, want_lse = cascade_prefix.prefix_decode_reference(q, keys, values, rows, scale)
                    err_o = mx.abs(o - want_o).max().item()
                    err_lse = mx.abs(mx.where(mx.isinf(want_lse), 0.0, lse - want_lse)).max().item()
                    same_inf = bool(mx.array_equal(mx.isinf(lse), mx.isinf(want_lse)).item())
                    print(
                        f"check prefix kernel {str(dtype).split('.')[-1]:>8} D={dim:3d} rows={batch:3d}"
                        f"{' (every other)' if subset else ''} H={heads} kvH={kv_heads} P={length} in "
                        f"{o.shape[0]} parts: o {err_o:.2e}, lse {err_lse:.2e}, empty parts agree {same_inf}",
                        flush=True,
                    )
                except Exception as exc:
                    print(f"check prefix kernel: failed: {type(exc).__name__}: {str(exc)[:800]}", flush=True)
                    return


def tune_prefix_kernel(model: Any, rows_list: list[int], prefix: int, iters: int) -> None:
    """The prefix kernel's part of a layer (kernel + merge of its splits) by warps per block and blocks aimed at,
    per layer in a stack of the model's layers, beside the mx-ops prefix part it replaces."""
    import mlx.core as mx

    a = model.args
    dtype = model.layers[0].self_attn.q_proj.weight.dtype
    if not cascade_decode.prefix_supported(dtype, a.num_attention_heads, a.num_key_value_heads, a.head_dim):
        return
    layers, kv_heads, g = len(model.layers), a.num_key_value_heads, a.num_attention_heads // a.num_key_value_heads
    scale = a.head_dim**-0.5
    keys, values = (random_array((1, kv_heads, prefix, a.head_dim), dtype) for _ in range(2))
    levels = [Level(keys, values, None, None)]

    def stacked(fn: Any) -> str:
        total, build = stacked_ms(fn, layers, max(2, iters // 4))
        return f"{total:.3f} ({build:.3f} building)"

    saved = cascade_prefix._WARPS, cascade_prefix.TARGET_BLOCKS
    try:
        for rows in rows_list:
            q = random_array((rows, a.num_attention_heads, 1, a.head_dim), dtype)
            mx.eval(q, keys, values)
            mx_part = cascade_decode._decode_step(kv_heads, g, scale, (False,), False, (rows,), OPTIONS)
            cells = [f"mx ops {stacked(lambda q=q, f=mx_part: f(q, keys, values))}"]
            for warps in (4, 8):
                for target in (132, 264, 528):
                    cascade_prefix._WARPS, cascade_prefix.TARGET_BLOCKS = warps, target
                    parts = cascade_prefix.splits(rows * g, kv_heads, prefix)
                    ms = stacked(
                        lambda q=q, k=cascade_prefix.prefix_decode: cascade_decode._prefix_levels(
                            q, levels, scale, k, OPTIONS
                        )
                    )
                    cells.append(f"{warps}w/{target} ({parts} parts) {ms}")
            head = f"tune prefix part, {rows} rows x {prefix} keys, ms per layer (of it Python building): "
            print(head + ", ".join(cells), flush=True)
    finally:
        cascade_prefix._WARPS, cascade_prefix.TARGET_BLOCKS = saved


def print_steps(model: Any, args: argparse.Namespace, dtype: Any, cuda: bool, gpu: bool) -> None:
    p, o, s = args.prefix, args.own, args.small
    print(
        f"step: {p} shared + {o} own tokens per row; today = every row holds {p + o} "
        f"({'ragged kernel' if cuda else 'mlx-lm attention'}); goal: best cascade <= 1.3x today at {s}"
    )
    print(
        f"{'rows':>4} | {'today ' + str(s):>10} {'today ' + str(p + o):>10} | {'cascade mx':>10} {'eager':>7} "
        f"{'kernel':>7} {'prefix':>7} {'fused':>7} | {'tok/s today':>11} {'cascade':>8} | {'best/today ' + str(s):>14} "
        f"{'today/best':>10}"
    )
    for rows in [int(x) for x in args.rows.split(",")]:
        t = compare(model, rows, args, dtype, cuda, gpu)
        paths = (t["cascade_mx"], t["cascade_eager"], t["cascade_kernel"], t["cascade_prefix"], t["cascade_fused"])
        best = min([x for x in paths if x == x] or [float("nan")])
        print(
            f"{rows:4d} | {t['today_small']:10.2f} {t['today_full']:10.2f} | {t['cascade_mx']:10.2f} "
            f"{t['cascade_eager']:7.2f} {t['cascade_kernel']:7.2f} {t['cascade_prefix']:7.2f} "
            f"{t['cascade_fused']:7.2f} | "
            f"{rows / t['today_full'] * 1000:11.0f} "
            f"{rows / best * 1000:8.0f} | {best / t['today_small']:13.2f}x {t['today_full'] / best:9.2f}x",
            flush=True,
        )
        names = ["today_small", "today_full", "cascade_mx", "cascade_eager", "cascade_kernel", "cascade_prefix"]
        names.append("cascade_fused")
        names = [n for n in names if n in t]
        built = ", ".join(f"{n} {t[n + '_build']:.2f} ({t[n + '_nodes']} nodes)" for n in names if f"{n}_build" in t)
        print(f"     of which Python building the step's graph, ms: {built}", flush=True)
        print(
            f"     one layer's attention alone, ms: today {t['layer_today']:.3f}, cascade mx {t['layer_mx']:.3f} "
            f"(its prefix part {t['layer_prefix']:.3f}), kernel {t['layer_kernel']:.3f}, fused {t['layer_fused']:.3f}, "
            f"both kernels {t['layer_both']:.3f} (the prefix kernel's part {t['layer_prefix_kernel']:.3f})",
            flush=True,
        )
        st = {k: f"{t[k][0]:.3f} ({t[k][1]:.3f})" for k in t if k.startswith("stack_")}
        print(
            f"     per layer in a stack of the model's layers, ms (of it Python building): today {st['stack_today']}, "
            f"kernel {st['stack_kernel']} (its prefix part in mx ops {st['stack_prefix']}), both kernels "
            f"{st['stack_both']} (the prefix kernel's part {st['stack_prefix_kernel']})",
            flush=True,
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="tiny | PATH | gguf:FILE | random:qwen3-8b ...")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--rows", default="32,64,128")
    ap.add_argument("--prefix", type=int, default=3072, help="shared prefix tokens")
    ap.add_argument("--own", type=int, default=64, help="own tokens per row")
    ap.add_argument("--small", type=int, default=128, help="today's path at this context: the goal's baseline")
    ap.add_argument("--iters", type=int, default=20, help="steps per timing")
    ap.add_argument("--repeat", type=int, default=3, help="timings per configuration, interleaved; the median counts")
    ap.add_argument("--admit-rows", default="8,16", help="requests admitted at once (the prefill batch)")
    ap.add_argument("--admit-suffix", type=int, default=32, help="own tokens each admitted request prefills")
    ap.add_argument("--floor-rows", default="1,32,128")
    ap.add_argument("--floor-context", type=int, default=128)
    ap.add_argument("--skip", default="", help="comma list of sections to skip: check, step, admit, floor")
    ap.add_argument(
        "--emulate-cuda",
        action="store_true",
        help="run the CUDA-only parts with the kernels' mx-ops references: checks this script on a CPU (the figures "
        "mean nothing)",
    )
    ap.add_argument("--quick", action="store_true", help="rows 2,4; prefix 256; own 16; small 32; 5 steps, once")
    args = ap.parse_args()
    if args.quick:
        args.rows, args.prefix, args.own, args.small, args.iters, args.repeat = "2,4", 256, 16, 32, 5, 1
        args.floor_rows, args.floor_context, args.admit_rows, args.admit_suffix = "1,4", 32, "2", 8
    skip = set(filter(None, args.skip.split(",")))

    import mlx.core as mx

    if args.emulate_cuda:
        attention.available = lambda: True
        attention.ragged_decode = attention.ragged_reference
        cascade_kernel.suffix_decode = cascade_kernel.suffix_decode_reference
        cascade_prefix.prefix_decode = cascade_prefix.prefix_decode_reference
    loaded = load_bench_model(args.model, dtype=args.dtype)
    model = loaded.model
    cuda = attention.available() and routing.install(model)
    if not (routing.install(model) and routing.cascade_eligible(model)):
        sys.exit(f"{args.model}: cascade attention does not apply to this model type")
    gpu = mx.default_device() == mx.gpu or args.emulate_cuda
    dtype = model.layers[0].self_attn.q_proj.weight.dtype
    print(
        f"model {args.model} ({dtype}); device {mx.default_device()}; CUDA kernels {'on' if cuda else 'off'}; "
        f"ms per step, median of {args.repeat} interleaved timings of {args.iters} steps",
        flush=True,
    )
    if cuda and "check" not in skip:
        check_prefix_kernel()
        check_kernel()
        tune_prefix_kernel(model, [int(x) for x in args.rows.split(",")], args.prefix, args.iters)
    if "step" not in skip:
        print_steps(model, args, dtype, cuda, gpu)
    if "admit" not in skip:
        for rows in [int(x) for x in args.admit_rows.split(",")]:
            today, ours = admit_ms(model, rows, args.prefix, args.admit_suffix, dtype, args.iters)
            print(
                f"admit {rows} rows of {args.prefix} shared + {args.admit_suffix} own tokens (merge + prefill): "
                f"today {today:.2f} ms, cascade {ours:.2f} ms ({today / ours:.2f}x)",
                flush=True,
            )
    if "floor" not in skip:
        for rows in [int(x) for x in args.floor_rows.split(",")]:
            floor(model, rows, args.floor_context, args.iters, dtype, cuda)


if __name__ == "__main__":
    main()
