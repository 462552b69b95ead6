"""Benchmark: a whole job of many questions over one long preamble, cascade attention on vs off vs batch_generate.

One preamble (a document or system prompt) of --preamble tokens, then --questions requests, each the preamble
followed by its own --question-tokens random tokens; --max-tokens out, EOS ignored everywhere. Side by side:
  cascade      omlx-jobs, whole job (store rows -> every result stored), rows reference the cached preamble
  mxprefix     cascade with its CUDA decode steps attending the preamble in mx ops, not worker/cascade_prefix.py's
               kernel (OMLX_JOBS_CASCADE_PREFIX_KERNEL=0); on other devices the same as cascade
  off          the same with cascade off (as OMLX_JOBS_CASCADE=0): each row holds a copy of the preamble
  today        off, and on the CPU also without worker/cpu_prefill.py (OMLX_JOBS_CPU_PREFILL=0): the engine as it
               was before cascade attention (on GPUs the same as off, which it then need not be run beside)
  bg           mlx_lm.batch_generate on the same prompts and batch sizes
Each runs in a process of its own (after a small unmeasured job that compiles its kernels), so that its peak
memory is its own: on a GPU mx.get_peak_memory() of the measured job, on the CPU the process's peak RSS (model
included; the RSS after loading is given too). Wall time, and the engine's split (warm-ups, suffix prefill,
decode), are printed for each, with the ratios.

    .venv/bin/python bench/engine/cascade_job.py --model tiny --preamble 256 --questions 16       # CPU check, seconds
    .venv/bin/python bench/engine/cascade_job.py --model gguf:$(.venv/bin/omlx-jobs models smollm2-path) \\
        --preamble 2000 --questions 64 --batch-size 64                                    # CPU, SmolLM2
    python bench/engine/cascade_job.py --model random:qwen3-8b --dtype bfloat16 --batch-size 128 --warm job  # GPU
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import omlx_jobs.worker  # fast BLAS before mlx

RUNS = ("cascade", "mxprefix", "off", "today", "bg")


def prompts_for(vocab: int, preamble: int, questions: int, question_tokens: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lo, hi = 100, max(200, min(vocab - 100, 30000))
    pre = [rng.randrange(lo, hi) for _ in range(preamble)]
    return [pre + [rng.randrange(lo, hi) for _ in range(question_tokens)] for _ in range(questions)]


def rss_bytes() -> int:
    """The process's peak resident set so far (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if platform.system() == "Darwin" else peak * 1024)


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One run in this process: load, compile on a small job, then the measured job; returns its figures."""
    import mlx.core as mx

    from bench.engine.prefix import Workload, run_batch_generate, run_ours
    from bench.lib.models import load_bench_model
    from omlx_jobs.defaults import Switches
    from omlx_jobs.worker.engine.config import EngineConfig

    loaded = load_bench_model(args.model, dtype=args.dtype)
    mx.eval(loaded.model.parameters())
    vocab = loaded.vocab_size
    prompts = prompts_for(vocab, args.preamble, args.questions, args.question_tokens)
    job = Workload("job", prompts, max_tokens=args.max_tokens)
    if args.warm == "job":  # what a long-lived worker has compiled after its first shard: every shape of the job
        warm = Workload(
            "warm",
            prompts_for(vocab, args.preamble, args.questions, args.question_tokens, seed=1),
            max_tokens=args.max_tokens,
        )
    else:
        small = prompts_for(vocab, min(args.preamble, 256), min(args.questions, 16), args.question_tokens, seed=1)
        warm = Workload("warm", small, max_tokens=4)
    env = Switches.from_env()
    base = dict(
        completion_batch_size=args.batch_size,
        prefill_batch_size=args.prefill_batch_size,
        ignore_eos=True,
        min_shared_tokens=args.min_shared_tokens,
        cache_memory=None,
        switches=dataclasses.replace(
            env,
            cascade=args.child in ("cascade", "mxprefix"),
            cpu_prefill=env.cpu_prefill and args.child != "today",
            cascade_prefix_kernel=env.cascade_prefix_kernel and args.child != "mxprefix",
        ),
    )
    gpu = mx.default_device() == mx.gpu
    with tempfile.TemporaryDirectory() as tmp:
        if args.child == "bg":
            run_batch_generate(loaded, warm, args.batch_size, args.prefill_batch_size)
        else:
            run_ours(loaded, warm, "warm", EngineConfig(**base), Path(tmp))
        mx.synchronize()
        mx.clear_cache()
        rss_before = rss_bytes()
        mx.reset_peak_memory()
        if args.child == "bg":
            run = run_batch_generate(loaded, job, args.batch_size, args.prefill_batch_size)
        else:
            run = run_ours(loaded, job, args.child, EngineConfig(**base), Path(tmp))
        peak_gpu = mx.get_peak_memory() if gpu else None
    return {
        "run": args.child,
        "seconds": round(run.seconds, 3),
        "prefill_tokens": run.prefill_tokens,
        "peak_gpu_bytes": peak_gpu,
        "peak_rss_bytes": rss_bytes(),
        "rss_after_load_bytes": rss_before,
        "device": str(mx.default_device()),
        **run.extra,
    }


def spawn(args: argparse.Namespace, run: str) -> dict[str, Any]:
    argv = [sys.executable, __file__, *sys.argv[1:], "--child", run]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}  # the child sets its switches from --child
    out = subprocess.run(argv, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        print(f"-- {run} failed (exit {out.returncode}):\n{out.stderr[-3000:]}", flush=True)
        return {"run": run, "error": out.stderr[-500:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def gb(n: int | None) -> str:
    return f"{n / 1e9:.2f}" if n else "-"


def report(rows: list[dict[str, Any]]) -> dict[str, Any]:
    print(
        f"{'run':8} {'wall s':>8} {'warm-up s':>9} {'prefill s':>9} {'decode s':>9} {'peak GPU GB':>11} "
        f"{'peak RSS GB':>11} {'RSS at start':>12}"
    )
    for r in rows:
        if "error" in r:
            print(f"{r['run']:8} failed")
            continue
        print(
            f"{r['run']:8} {r['seconds']:8.2f} {r.get('warmup_s', '-'):>9} {r.get('prefill_s', '-'):>9} "
            f"{r.get('decode_s', '-'):>9} {gb(r['peak_gpu_bytes']):>11} {gb(r['peak_rss_bytes']):>11} "
            f"{gb(r['rss_after_load_bytes']):>12}"
        )
    by = {r["run"]: r for r in rows if "error" not in r}
    ratios: dict[str, float] = {}
    c = by.get("cascade")
    for other in ("mxprefix", "off", "today", "bg"):
        if c and other in by:
            ratios[f"wall_{other}_over_cascade"] = round(by[other]["seconds"] / c["seconds"], 2)
    for other in ("mxprefix", "off", "today"):
        if c and other in by and c.get("decode_s"):
            ratios[f"decode_{other}_over_cascade"] = round(by[other]["decode_s"] / c["decode_s"], 2)
    print("ratios:", ratios)
    return ratios


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="tiny | PATH | gguf:FILE | random:qwen3-0.6b | random:qwen3-8b")
    ap.add_argument("--dtype", default=None, help="weights dtype for random models")
    ap.add_argument("--preamble", type=int, default=3000)
    ap.add_argument("--questions", type=int, default=192)
    ap.add_argument("--question-tokens", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--prefill-batch-size", type=int, default=8)
    ap.add_argument("--min-shared-tokens", type=int, default=16)
    ap.add_argument("--runs", default="cascade,off,bg", help="any of cascade,mxprefix,off,today,bg")
    ap.add_argument(
        "--warm",
        choices=("small", "job"),
        default="small",
        help="the unmeasured run before the measured one: a small job (enough on the CPU), or a job of the same "
        "shapes with other tokens (on CUDA, where kernels are compiled at their first use: a long-lived worker "
        "has compiled them after its first shard)",
    )
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument("--child", choices=RUNS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args)), flush=True)
        return
    print(
        f"model {args.model} ({args.dtype or 'its dtype'}); {args.questions} questions of {args.question_tokens} "
        f"tokens after one {args.preamble}-token preamble, {args.max_tokens} tokens out, batch {args.batch_size}, "
        f"prefill batch {args.prefill_batch_size}; {platform.machine()} {platform.system()}, "
        f"BLAS {omlx_jobs.worker.models.blas.loaded}; load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    rows = []
    for run in args.runs.split(","):
        rows.append(spawn(args, run))
        print(f"   {run}: {rows[-1].get('seconds', 'failed')} s", flush=True)
    ratios = report(rows)
    print(f"load average at the end {os.getloadavg()[0]:.1f}")
    if args.json:
        args.json.write_text(
            json.dumps({"argv": sys.argv, "date": time.strftime("%Y-%m-%d"), "runs": rows, "ratios": ratios}, indent=1)
        )


if __name__ == "__main__":
    main()
