"""Benchmark: prefix-aware engine vs mlx_lm.batch_generate and vs our own engine with the cache off.

Workloads (token-id prompts, so any model works, random weights included):
  a  4 system prompts of ~1,000 tokens, each followed by 64 requests with ~32 unique tokens; 32 output tokens
  b  256 prompts with no shared prefix (512 tokens each); 32 output tokens
  c  32 multi-turn conversations growing over 4 turns (each turn repeats the earlier ones), one batch
  d  64 prompts (256 tokens) with n=4

For each workload, side by side in one process on the same loaded model:
  - mlx_lm.batch_generate on the same prompts (n=4 as 4 copies), same batch sizes
  - omlx-jobs, whole job (store rows -> every result stored): cache off, cache unbounded, cache capped at 25%
    of the unbounded run's peak cache bytes
and prints wall-time ratios and prefill tokens computed / trie minimum. EOS is ignored everywhere so every
path generates the same number of tokens.

    .venv/bin/python bench/engine/prefix.py --quick                      # tiny random model, small workloads
    .venv/bin/python bench/engine/prefix.py --model gguf:PATH            # e.g. SmolLM2-135M on CPU
    python3 bench/engine/prefix.py --model random:qwen3-8b --dtype bfloat16   # on a GPU
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import omlx_jobs.worker  # fast BLAS before mlx
from bench.lib.models import load_bench_model


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    n: int = 1
    max_tokens: int = 32
    note: str = ""


def make_workloads(
    vocab: tuple[int, int], scale: float, seed: int = 0, count_scale: float | None = None
) -> dict[str, Workload]:
    """Token-id workloads; `scale` shrinks lengths and counts, `count_scale` (if given) counts alone."""
    rng = random.Random(seed)

    def toks(n: int) -> list[int]:
        return [rng.randrange(*vocab) for _ in range(max(1, int(n)))]

    def count(n: int) -> int:
        return max(2, int(n * (scale if count_scale is None else count_scale)))

    sys_len, uniq = 1000 * scale, 32
    a = [s + toks(uniq) for s in [toks(sys_len) for _ in range(4)] for _ in range(count(64))]
    b = [toks(512 * scale) for _ in range(count(256))]
    c = []
    for _ in range(count(32)):
        turn = toks(200 * scale)
        for _ in range(4):
            c.append(list(turn))
            turn = turn + toks(64 * scale) + toks(32)
    d = [toks(256 * scale) for _ in range(count(64))]
    return {
        "a": Workload("a", a, note="4 system prompts x 64 requests"),
        "b": Workload("b", b, note="no shared prefix"),
        "c": Workload("c", c, note="32 conversations x 4 turns"),
        "d": Workload("d", d, n=4, note="64 prompts, n=4"),
    }


@dataclass
class Run:
    label: str
    seconds: float
    prefill_tokens: int = 0
    trie_min_tokens: int = 0
    peak_cache_bytes: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        return self.prefill_tokens / self.trie_min_tokens if self.trie_min_tokens else float("nan")


def run_batch_generate(loaded: Any, w: Workload, batch: int, prefill_batch: int) -> Run:
    import mlx.core as mx
    from mlx_lm.generate import batch_generate

    prompts = [p for p in w.prompts for _ in range(w.n)]
    tok = _NoEos(loaded.tokenizer)
    mx.synchronize()
    t = time.perf_counter()
    res = batch_generate(
        loaded.model,
        tok,
        prompts,
        max_tokens=w.max_tokens,
        completion_batch_size=batch,
        prefill_batch_size=prefill_batch,
    )
    mx.synchronize()
    seconds = time.perf_counter() - t
    computed = sum(len(p) for p in prompts)
    return Run(
        "mlx_lm.batch_generate",
        seconds,
        prefill_tokens=computed,
        extra={"prompt_tps": round(res.stats.prompt_tps, 1), "generation_tps": round(res.stats.generation_tps, 1)},
    )


class _NoEos:
    """The model's tokenizer with no EOS, so batch_generate generates max_tokens like our ignore_eos runs."""

    def __init__(self, tok: Any) -> None:
        self._tok = tok
        self.eos_token_ids: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tok, name)


def run_ours(loaded: Any, w: Workload, label: str, config: Any, workdir: Path, rep: int = 0) -> Run:
    """The whole job: rows into a fresh store, run_shard until every result is stored."""
    import mlx.core as mx

    from omlx_jobs.jobs.submit import load_job
    from omlx_jobs.store import open_store
    from omlx_jobs.worker.engine.loop import Engine
    from omlx_jobs.worker.runtime.shard import run_shard

    src = workdir / f"{w.name}.jsonl"
    if not src.exists():
        with src.open("w") as f:
            for i, p in enumerate(w.prompts):
                f.write(
                    json.dumps(
                        {
                            "custom_id": f"{w.name}{i}",
                            "prompt": p,
                            "max_tokens": w.max_tokens,
                            "temperature": 0,
                            "n": w.n,
                        }
                    )
                    + "\n"
                )
    store = open_store(url=f"sqlite:///{workdir / f'{w.name}-{label}-{rep}.db'}")
    engine = Engine(loaded, config)
    mx.synchronize()
    t = time.perf_counter()
    job = load_job(store, src, loaded.ref)
    out = run_shard(store, engine, job.job_id)
    mx.synchronize()
    seconds = time.perf_counter() - t
    counts = store.counts(job.job_id)
    assert counts.completed == len(w.prompts), f"{label}: {counts}"
    s = out.stats
    return Run(
        label,
        seconds,
        prefill_tokens=s.prefill_tokens,
        trie_min_tokens=s.trie_min_tokens,
        peak_cache_bytes=engine.cache.stats.peak_bytes,
        extra={
            "warmups": s.warmups,
            "warmup_s": round(s.warmup_seconds, 2),
            "prefill_s": round(s.prefill_seconds, 2),
            "decode_s": round(s.decode_seconds, 2),
            "first_token_reuses": s.first_token_reuses,
            "evictions": engine.cache.stats.evictions,
        },
    )


def bench_workload(loaded: Any, w: Workload, args: argparse.Namespace, workdir: Path) -> list[Run]:
    from omlx_jobs.defaults import Switches
    from omlx_jobs.worker.engine.config import EngineConfig

    base = dict(
        completion_batch_size=args.batch_size,
        prefill_batch_size=args.prefill_batch_size,
        ignore_eos=True,
        min_shared_tokens=args.min_shared_tokens,
    )
    best: dict[str, Run] = {}

    def keep(run: Run) -> Run:
        if run.label not in best or run.seconds < best[run.label].seconds:
            best[run.label] = run
        return best[run.label]

    # Kernels are compiled for each new shape: run a slice of the workload through both engines unmeasured.
    sample = Workload(f"{w.name}-warm", w.prompts[:16], n=w.n, max_tokens=4)
    if "bg" in args.runs:
        run_batch_generate(loaded, sample, args.batch_size, args.prefill_batch_size)
    run_ours(loaded, sample, "warm", EngineConfig(cache_memory=None, **base), workdir)
    # Interleaved repeats, best wall time of each kept.
    for rep in range(args.repeat):
        if "bg" in args.runs:
            keep(run_batch_generate(loaded, w, args.batch_size, args.prefill_batch_size))
        if "off" in args.runs:
            keep(run_ours(loaded, w, "omlx-jobs, cache off", EngineConfig(prefix_cache=False, **base), workdir, rep))
        profiler = None
        if args.profile and rep == args.repeat - 1:
            import cProfile

            profiler = cProfile.Profile()
            profiler.enable()
        unbounded = keep(
            run_ours(loaded, w, "omlx-jobs, cache unbounded", EngineConfig(cache_memory=None, **base), workdir, rep)
        )
        if profiler is not None:
            import pstats

            profiler.disable()
            print(f"-- profile of omlx-jobs, cache unbounded, workload {w.name} (cumulative, top 30)")
            pstats.Stats(profiler).sort_stats("cumulative").print_stats(30)
        if "stock" in args.runs:
            no_kernel = dataclasses.replace(Switches.from_env(), ragged_decode=False)
            stock = EngineConfig(cache_memory=None, switches=no_kernel, **base)
            keep(run_ours(loaded, w, "omlx-jobs, mlx-lm attention", stock, workdir, rep))
        if "capped" in args.runs:
            cap = max(1, unbounded.peak_cache_bytes // 4)
            capped = run_ours(loaded, w, "omlx-jobs, cache 25%", EngineConfig(cache_memory=cap, **base), workdir, rep)
            capped.extra["cap_bytes"] = cap
            keep(capped)
    return list(best.values())


def report(w: Workload, runs: list[Run]) -> dict[str, Any]:
    by = {r.label: r for r in runs}
    bg, off = by.get("mlx_lm.batch_generate"), by.get("omlx-jobs, cache off")
    unb, cap = by["omlx-jobs, cache unbounded"], by.get("omlx-jobs, cache 25%")
    print(f"\n== workload {w.name}: {w.note}; {len(w.prompts)} prompts x n={w.n}, {w.max_tokens} output tokens")
    print(f"{'run':28} {'wall s':>8} {'computed':>9} {'minimum':>8} {'ratio':>6}  details")
    for r in runs:
        ratio = f"{r.ratio:.3f}" if r.trie_min_tokens else "-"
        print(f"{r.label:28} {r.seconds:8.2f} {r.prefill_tokens:9d} {unb.trie_min_tokens:8d} {ratio:>6}  {r.extra}")

    def ratio(a: Run | None, b: Run | None) -> float | None:
        return round(a.seconds / b.seconds, 3) if a and b else None

    summary = {
        "workload": w.name,
        "speedup_vs_batch_generate": ratio(bg, unb),
        "speedup_vs_cache_off": ratio(off, unb),
        "computed_over_min_unbounded": round(unb.ratio, 4),
        "computed_over_min_capped_25pct": round(cap.ratio, 4) if cap else None,
        "batch_generate_computed_over_min": round(bg.prefill_tokens / unb.trie_min_tokens, 3) if bg else None,
        "capped_speedup_vs_batch_generate": ratio(bg, cap),
        "runs": [r.__dict__ for r in runs],
    }
    print(
        f"-> {summary['speedup_vs_batch_generate']}x vs batch_generate, {summary['speedup_vs_cache_off']}x vs "
        f"cache off; computed/minimum {summary['computed_over_min_unbounded']} unbounded, "
        f"{summary['computed_over_min_capped_25pct']} at a 25% cap"
    )
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="tiny | PATH | gguf:FILE | random:qwen3-0.6b | random:qwen3-8b")
    ap.add_argument("--dtype", default=None, help="weights dtype for random models (float32, bfloat16, float16)")
    ap.add_argument("--quick", action="store_true", help="tiny model, workloads at 1/8 scale")
    ap.add_argument("--scale", type=float, default=None, help="workload scale (1.0 = as in the issue)")
    ap.add_argument("--workloads", default="a,b,c,d")
    ap.add_argument("--count-scale", type=float, default=None, help="scale request counts only")
    ap.add_argument(
        "--runs",
        default="bg,off,capped",
        help="besides the unbounded-cache run: bg (batch_generate), off (cache off), capped (25%% cache), "
        "stock (unbounded, with mlx-lm's masked decode attention instead of the ragged kernel; CUDA)",
    )
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--prefill-batch-size", type=int, default=8)
    ap.add_argument("--min-shared-tokens", type=int, default=16)
    ap.add_argument("--profile", action="store_true", help="cProfile the unbounded-cache run")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each configuration; the best is reported")
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args()
    if args.quick:
        args.model = "tiny" if args.model == "tiny" else args.model
    scale = args.scale if args.scale is not None else (0.125 if args.quick else 1.0)

    import mlx.core as mx

    t = time.perf_counter()
    loaded = load_bench_model(args.model, dtype=args.dtype)
    print(
        f"model {args.model} loaded in {time.perf_counter() - t:.1f}s; device {mx.default_device()}; "
        f"{platform.machine()} {platform.system()}; BLAS {omlx_jobs.worker.models.blas.loaded}"
    )
    vocab = (100, max(200, min(loaded.vocab_size - 100, 30000)))
    workloads = make_workloads(vocab, scale, count_scale=args.count_scale)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        # Warm up kernels on a small job so the first measured run is not penalized.
        warm = Workload("warm", [w[:64] for w in workloads["b"].prompts[:4]], max_tokens=4)
        bench_workload(loaded, warm, args, workdir)
        for name in args.workloads.split(","):
            w = workloads[name]
            results.append(report(w, bench_workload(loaded, w, args, workdir)))
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "model": args.model,
                    "scale": scale,
                    "device": str(mx.default_device()),
                    "date": time.strftime("%Y-%m-%d"),
                    "argv": sys.argv,
                    "results": results,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
