"""Benchmark: a job's decode step against the isolated step at the same rows and context, and where the rest goes.

Isolated: bench/lib/steps.pipelined_ms, R rows of C cached tokens, the next token the argmax of the logits,
steps pipelined as BatchGenerator runs them; and the same with mlx-lm's normalization (a log-softmax over
the vocabulary every step, what GenerationBatch._step computes before sampling).
Job: `Engine.run` on R requests of C - M/2 random tokens (no shared prefix, so rows hold their own tokens like
the isolated step's), batch R, every prompt prefilled in one admission, EOS ignored, M tokens out: the decode
steps' mean context is C. Per decode step: the backend's step (model, sampling, the host sync) and the
engine's own Python between steps (collect, commit, schedule). Run with the lazy normalization
(backend/decode.py, the default) and without it, interleaved over --rounds.

    .venv/bin/python bench/engine/step_overhead.py --model tiny --rows 32 --context 256 --max-tokens 64
    .venv/bin/python bench/engine/step_overhead.py --model gguf:$(.venv/bin/omlx-jobs models smollm2-path) \\
        --rows 32 --context 256 --max-tokens 32
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import omlx_jobs.worker  # noqa: F401  (fast BLAS before mlx)
from bench.lib.models import load_bench_model
from bench.lib.steps import own_caches, pipelined_ms


def isolated(loaded: Any, rows: int, context: int, iters: int, normalize: bool) -> float:
    """ms per pipelined step at `rows` x `context`; with `normalize`, sampling from mlx-lm's log-softmax."""
    import mlx.core as mx

    model = loaded.model
    dtype = model.layers[0].self_attn.q_proj.weight.dtype
    caches = own_caches(model, rows, context, dtype)
    tokens = mx.array([[7]] * rows)
    start = [c._idx for c in caches]
    if not normalize:
        return pipelined_ms(model, caches, tokens, start, iters)
    inner = model.__call__

    class Normalized:  # the model as GenerationBatch._step sees it: logits -> log-softmax before the argmax
        layers = model.layers

        def __call__(self, y: Any, cache: Any) -> Any:
            logits = inner(y, cache=cache)
            return logits - mx.logsumexp(logits, axis=-1, keepdims=True)

    return pipelined_ms(Normalized(), caches, tokens, start, iters)


def job(loaded: Any, args: argparse.Namespace, lazy: bool, seed: int) -> dict[str, Any]:
    """One Engine.run; ms per decode step split into the backend's step and the engine's Python around it."""
    from omlx_jobs.jobs.formats import SamplingParams
    from omlx_jobs.worker.backend import decode
    from omlx_jobs.worker.engine.config import EngineConfig
    from omlx_jobs.worker.engine.loop import Engine
    from omlx_jobs.worker.engine.sequence import WorkItem

    decode._BatchStepGeneration.lazy_logprobs = lazy
    rng = random.Random(seed)
    n = max(1, args.context - args.max_tokens // 2)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    hi = min(20000, loaded.vocab_size - 10)
    items = [WorkItem(i, [rng.randrange(10, hi) for _ in range(n)], params) for i in range(args.rows)]
    config = EngineConfig(
        completion_batch_size=args.rows, prefill_batch_size=args.rows, ignore_eos=True, prefix_cache=False
    )
    engine = Engine(loaded, config)
    steps: list[tuple[float, int]] = []
    opened = engine.backend.open

    def open_timed(cache: Any = None) -> Any:
        batch = opened(cache)
        step = batch.step

        def timed_step() -> Any:
            t = time.perf_counter()
            out = step()
            steps.append((time.perf_counter() - t, len(out)))
            return out

        batch.step = timed_step
        return batch

    engine.backend.open = open_timed  # type: ignore[method-assign]
    profiler = cProfile.Profile() if args.profile and lazy else None
    t0 = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    stats = engine.run(items, lambda results: None)
    if profiler is not None:
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(20)
        print(text.getvalue())
    wall = time.perf_counter() - t0
    full = [s for s, k in steps if k == args.rows]  # decode steps of the whole batch (not the prefill's)
    decode_total = sum(full)
    between = stats.seconds - stats.warmup_seconds - sum(s for s, _ in steps)  # the engine outside batch.step
    return {
        "lazy_logprobs": lazy,
        "wall_s": round(wall, 3),
        "decode_steps": len(full),
        "step_ms_median": round(1000 * statistics.median(full), 2),
        "step_ms_mean": round(1000 * decode_total / max(1, len(full)), 2),
        "engine_python_ms_per_step": round(1000 * max(0.0, between) / max(1, len(full)), 2),
        "job_ms_per_step": round(1000 * (decode_total + max(0.0, between)) / max(1, len(full)), 2),
        "tokens": stats.generation_tokens,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="tiny | PATH | gguf:FILE")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--profile", action="store_true", help="cProfile the last lazy job run (top 20 by own time)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    import mlx.core as mx

    loaded = load_bench_model(args.model)
    mx.eval(loaded.model.parameters())
    print(
        f"model {args.model}; {args.rows} rows, context {args.context}, {args.max_tokens} out; "
        f"{mx.default_device()}; load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    job(loaded, argparse.Namespace(**{**vars(args), "max_tokens": 4, "profile": False}), True, 99)  # compile, warm
    rounds: list[dict[str, Any]] = []
    for r in range(args.rounds):
        iso = isolated(loaded, args.rows, args.context, args.iters, normalize=False)
        iso_norm = isolated(loaded, args.rows, args.context, args.iters, normalize=True)
        runs = [job(loaded, args, lazy, seed=r) for lazy in ((True, False) if r % 2 == 0 else (False, True))]
        rounds.append({"isolated_ms": round(iso, 2), "isolated_normalized_ms": round(iso_norm, 2), "jobs": runs})
        print(f"round {r}: isolated {iso:.2f} ms/step, isolated + mlx-lm's log-softmax {iso_norm:.2f} ms", flush=True)
        for j in runs:
            print(
                f"   job lazy_logprobs={j['lazy_logprobs']!s:5}: {j['job_ms_per_step']:8.2f} ms/step = step "
                f"{j['step_ms_mean']:.2f} (median {j['step_ms_median']:.2f}) + engine "
                f"{j['engine_python_ms_per_step']:.2f}; {j['decode_steps']} full steps; job/isolated tok/s "
                f"{iso / j['job_ms_per_step']:.3f}",
                flush=True,
            )
    print(f"load average at the end {os.getloadavg()[0]:.1f}")
    if args.json:
        args.json.write_text(json.dumps({"argv": sys.argv, "date": time.strftime("%Y-%m-%d"), "rounds": rounds}))


if __name__ == "__main__":
    main()
