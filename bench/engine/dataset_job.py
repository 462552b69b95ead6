"""Benchmark: decode-bound jobs with several prefix groups (the dataset-generation shape), side by side.

Presets (token-id prompts, EOS ignored everywhere, the same batch sizes for every run):
  dataset   8 system prompts of 200-400 tokens, 32 requests each of 16-48 own tokens, 256 tokens out
  sys6      6 system prompts of 500-2,400 tokens, 40 requests each, 48 tokens out
  twolevel  one 300-token system prompt over 4 documents of 2,000 tokens, 48 questions each, 32 tokens out
Runs, each in a process of its own after an unmeasured job of the same shapes (other tokens):
  cascade   the default engine          off   cascade off (OMLX_JOBS_CASCADE=0)          bg   mlx_lm.batch_generate
  nopack    one call per level (OMLX_JOBS_CASCADE_PACKED=0)   packed   one packed call, also on the CPU (=1)
  nocost   every level referenced (OMLX_JOBS_CASCADE_COST=0)
  step      the isolated decode step (bench/lib/steps.py, pipelined as BatchGenerator runs it, today's routing)
            at the job's rows and mean context (prompt + half the answer): the tok/s a job's decode could reach
Per run: wall, the engine's split, decode steps and ms per step, generated tok/s in decode and its share of the
isolated step's, graphs compiled by the cascade decode path (memo misses: measured job + its warm-up), and with
--profile the top functions of a cProfile of the measured job.

    .venv/bin/python bench/engine/dataset_job.py --model tiny --preset dataset --scale 0.1            # CPU check
    python3 bench/engine/dataset_job.py --model random:qwen3-8b --dtype bfloat16 --preset dataset --batch-size 128
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import omlx_jobs.worker  # noqa: F401  (fast BLAS before mlx)

RUNS = ("cascade", "off", "bg", "nopack", "packed", "nocost", "step")
ENV = {
    "off": {"OMLX_JOBS_CASCADE": "0"},
    "nopack": {"OMLX_JOBS_CASCADE_PACKED": "0"},
    "packed": {"OMLX_JOBS_CASCADE_PACKED": "1"},
    "nocost": {"OMLX_JOBS_CASCADE_COST": "0"},
}
"""The environment each run's process gets on top of this one's."""


def preset_prompts(name: str, vocab: int, scale: float, seed: int) -> tuple[list[list[int]], int]:
    """(prompts in group order, max_tokens) for a preset; `scale` shrinks lengths and counts."""
    rng = random.Random(seed)
    lo, hi = 100, max(200, min(vocab - 100, 30000))

    def toks(n: float) -> list[int]:
        return [rng.randrange(lo, hi) for _ in range(max(1, int(n * scale)))]

    def count(n: int) -> int:
        return max(2, int(n * scale))

    if name == "dataset":
        systems = [toks(rng.randrange(200, 401)) for _ in range(8)]
        return [s + toks(rng.randrange(16, 49)) for s in systems for _ in range(count(32))], max(4, int(256 * scale))
    if name == "sys6":
        systems = [toks(rng.randrange(500, 2401)) for _ in range(6)]
        return [s + toks(rng.randrange(16, 49)) for s in systems for _ in range(count(40))], max(4, int(48 * scale))
    if name == "twolevel":
        system = toks(300)
        docs = [system + toks(2000) for _ in range(4)]
        return [d + toks(rng.randrange(12, 33)) for d in docs for _ in range(count(48))], max(4, int(32 * scale))
    raise SystemExit(f"unknown preset {name!r}")


def _count_compiles() -> dict[str, int]:
    """Count the cascade decode path's graph builds (misses of its memo) from here on."""
    from omlx_jobs.worker.attention.options import Graphs

    counts = {"graphs": 0}
    original = Graphs.get

    def counting(memo: dict[Any, Any], key: Any, build: Any, compiled: bool) -> Any:
        if key not in memo:
            counts["graphs"] += 1
        return original(memo, key, build, compiled)

    Graphs.get = staticmethod(counting)  # type: ignore[method-assign]
    return counts


def _count_steps() -> dict[str, int]:
    from omlx_jobs.worker.backend import decode

    counts = {"steps": 0}
    original = decode.DecodeBatch.step

    def step(self: Any) -> Any:
        counts["steps"] += 1
        return original(self)

    decode.DecodeBatch.step = step  # type: ignore[method-assign]
    return counts


def isolated_step(args: argparse.Namespace) -> dict[str, Any]:
    """The decode step alone at the job's rows and mean context, as the engine's routing runs today's path."""
    import mlx.core as mx

    from bench.lib.models import load_bench_model
    from bench.lib.steps import own_caches, pipelined_ms
    from omlx_jobs.worker.attention import routing
    from omlx_jobs.worker.attention.kernels import ragged
    from omlx_jobs.worker.attention.options import Routing

    loaded = load_bench_model(args.model, dtype=args.dtype)
    mx.eval(loaded.model.parameters())
    prompts, max_tokens = preset_prompts(args.preset, loaded.vocab_size, args.scale, seed=0)
    rows = min(args.batch_size, len(prompts))
    context = sum(len(p) for p in prompts) // len(prompts) + max_tokens // 2
    dtype = loaded.model.layers[0].self_attn.k_proj.weight.dtype
    dtype = mx.float32 if dtype not in (mx.float16, mx.bfloat16, mx.float32) else dtype
    caches = own_caches(loaded.model, rows, context, dtype)
    kernel = ragged.ragged_decode if ragged.available() and routing.install(loaded.model) else None
    with routing.active(Routing(ragged=kernel)):
        ms = pipelined_ms(loaded.model, caches, mx.array([[7]] * rows), [c._idx for c in caches], args.step_iters)
    return {
        "run": "step",
        "rows": rows,
        "context": context,
        "ms_per_step": round(ms, 2),
        "decode_tok_s": round(rows / ms * 1000, 1),
    }


def child(args: argparse.Namespace) -> dict[str, Any]:
    import mlx.core as mx

    from bench.engine.prefix import Workload, run_batch_generate, run_ours
    from bench.lib.models import load_bench_model
    from omlx_jobs.defaults import Switches
    from omlx_jobs.worker.engine.config import EngineConfig

    loaded = load_bench_model(args.model, dtype=args.dtype)
    mx.eval(loaded.model.parameters())
    prompts, max_tokens = preset_prompts(args.preset, loaded.vocab_size, args.scale, seed=0)
    warm_prompts, _ = preset_prompts(args.preset, loaded.vocab_size, args.scale, seed=1)
    job, warm = Workload("job", prompts, max_tokens=max_tokens), Workload("warm", warm_prompts, max_tokens=max_tokens)
    config = dict(
        completion_batch_size=args.batch_size,
        prefill_batch_size=args.prefill_batch_size,
        ignore_eos=True,
        min_shared_tokens=args.min_shared_tokens,
        cache_memory=None,
        switches=Switches.from_env(),
    )
    compiles, steps = _count_compiles(), _count_steps()
    gpu = mx.default_device() == mx.gpu
    profile = cProfile.Profile() if args.profile else None
    with tempfile.TemporaryDirectory() as tmp:
        if args.child == "bg":
            run_batch_generate(loaded, warm, args.batch_size, args.prefill_batch_size)
        else:
            run_ours(loaded, warm, "warm", EngineConfig(**config), Path(tmp))
        mx.synchronize()
        warm_graphs = compiles["graphs"]
        compiles["graphs"], steps["steps"] = 0, 0
        mx.reset_peak_memory()
        if profile is not None:
            profile.enable()
        if args.child == "bg":
            run = run_batch_generate(loaded, job, args.batch_size, args.prefill_batch_size)
        else:
            run = run_ours(loaded, job, args.child, EngineConfig(**config), Path(tmp))
        if profile is not None:
            profile.disable()
    decode_s = run.extra.get("decode_s")
    generated = len(prompts) * max_tokens
    out = {
        "run": args.child,
        "seconds": round(run.seconds, 3),
        "prompts": len(prompts),
        "max_tokens": max_tokens,
        "decode_steps": steps["steps"] or None,
        "ms_per_step": round(1000 * decode_s / steps["steps"], 2) if decode_s and steps["steps"] else None,
        "decode_tok_s": round(generated / decode_s, 1) if decode_s else None,
        "graphs_compiled": compiles["graphs"],
        "graphs_compiled_warm": warm_graphs,
        "peak_gpu_bytes": mx.get_peak_memory() if gpu else None,
        **run.extra,
    }
    if profile is not None:
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(35)
        pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats("omlx_jobs|mlx_lm", 40)
        out["profile"] = text.getvalue()
    return out


def spawn(args: argparse.Namespace, run: str) -> dict[str, Any]:
    argv = [sys.executable, __file__, *sys.argv[1:], "--child", run]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", **ENV.get(run, {})}
    out = subprocess.run(argv, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        print(f"-- {run} failed (exit {out.returncode}):\n{out.stderr[-3000:]}", flush=True)
        return {"run": run, "error": out.stderr[-500:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def report(rows: list[dict[str, Any]]) -> dict[str, float]:
    cols = ("seconds", "warmup_s", "prefill_s", "decode_s", "decode_steps", "ms_per_step", "decode_tok_s")
    by = {r["run"]: r for r in rows if "error" not in r}
    step = by.get("step", {}).get("decode_tok_s")
    print(f"{'run':8} " + " ".join(f"{c:>12}" for c in (*cols, "of_step", "graphs")))
    for r in rows:
        if "error" in r:
            print(f"{r['run']:8} failed")
            continue
        graphs = f"{r['graphs_compiled']}+{r['graphs_compiled_warm']}w" if "graphs_compiled" in r else "-"
        share = "-"
        if step and r.get("decode_tok_s") and r["run"] != "step":
            share = r["of_step"] = round(r["decode_tok_s"] / step, 2)
        fields = " ".join(f"{r.get(c) if r.get(c) is not None else '-':>12}" for c in cols)
        print(f"{r['run']:8} {fields} {share:>12} {graphs}")
    if "step" in by:
        print(f"step: {by['step']['rows']} rows at {by['step']['context']} tokens of context")
    ratios: dict[str, float] = {}
    if "cascade" in by:
        for other in ("off", "bg", "nopack", "packed", "nocost"):
            if other in by:
                ratios[f"wall_{other}_over_cascade"] = round(by[other]["seconds"] / by["cascade"]["seconds"], 2)
    if "off" in by and "bg" in by:
        ratios["wall_bg_over_off"] = round(by["bg"]["seconds"] / by["off"]["seconds"], 2)
    print("ratios:", ratios)
    return ratios


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="tiny | PATH | gguf:FILE | random:qwen3-0.6b | random:qwen3-8b")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--preset", default="dataset", choices=("dataset", "sys6", "twolevel"))
    ap.add_argument("--scale", type=float, default=1.0, help="shrink lengths and counts (CPU checks)")
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--prefill-batch-size", type=int, default=8)
    ap.add_argument("--min-shared-tokens", type=int, default=16)
    ap.add_argument("--runs", default="cascade,off,bg,step", help=f"comma-separated, of {', '.join(RUNS)}")
    ap.add_argument("--step-iters", type=int, default=20, help="timed steps of the isolated step")
    ap.add_argument("--profile", action="store_true", help="cProfile the measured job (ours) and print its top")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--child", choices=RUNS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(isolated_step(args) if args.child == "step" else child(args)), flush=True)
        return
    print(f"model {args.model} ({args.dtype}); preset {args.preset} x{args.scale}; batch {args.batch_size}", flush=True)
    rows = []
    for run in args.runs.split(","):
        rows.append(spawn(args, run))
        done = rows[-1]
        said = f"{done['seconds']} s" if "seconds" in done else f"{done.get('ms_per_step', 'failed')} ms a step"
        print(f"   {run}: {said}", flush=True)
    ratios = report(rows)
    for r in rows:
        if r.get("profile"):
            print(f"\n==== profile: {r['run']}\n{r['profile']}")
    if args.json:
        slim = [{k: v for k, v in r.items() if k != "profile"} for r in rows]
        args.json.write_text(json.dumps({"argv": sys.argv, "date": time.strftime("%F"), "runs": slim, **ratios}))


if __name__ == "__main__":
    main()
