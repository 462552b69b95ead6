"""Benchmark: where a decode-bound job's steps go, step by step, in one process (issue 22, item 2).

Loads the model once, runs an unmeasured warm-up job, times the isolated decode step
(bench/lib/steps.pipelined_ms) at the job's rows and mean context, then the `dataset_job.py` preset once per variant:
  base      the engine as configured (prefill passes of --prefill-batch-size rows or more, up to the
            engine's prefill_tokens; a running batch refilled once refill_rows are free)
  old       as before issue 22's refill rule: passes of exactly --prefill-batch-size rows, refilled at once
  keep      mlx-lm's `mx.clear_cache()` after every prompt chunk (and every 512 steps) made a no-op
  pbN       prefill batches of N rows (for example pb32)
  pbN+keep  both
  phases    (with any of the above) each prompt chunk, split, generate, extend and filter timed between device
            syncs (the syncs change the timeline: read the split, not the wall)
Per variant: wall, the engine's split, and each `DecodeBatch.step` call timed: steps with prompt processing in
them, and decode-only steps (their median against the isolated step), plus `clear_cache` calls.

    .venv/bin/python bench/engine/step_trace.py --model tiny --scale 0.1 --batch-size 16 --variants base,keep
    python3 bench/engine/step_trace.py --model random:qwen3-8b --dtype bfloat16 --batch-size 128 \\
        --variants base,keep,pb32,pb32+keep
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import omlx_jobs.worker  # noqa: F401  (fast BLAS before mlx)


class Trace:
    """Times every DecodeBatch.step and counts prompt chunks and buffer-cache clears inside it."""

    def __init__(self) -> None:
        import importlib

        import mlx.core as mx

        from omlx_jobs.worker.backend import decode

        generate = importlib.import_module("mlx_lm.generate")  # the module (mlx_lm.generate is also a function)
        self.keep = False
        self.phases = False
        self.phase: dict[str, float] = {}
        self.shapes: set[tuple[int, int]] = set()
        self.steps: list[tuple[float, int]] = []  # (seconds, prompt chunks in the step)
        self.clears = 0
        self._prompts = 0
        clear, prompt, step = mx.clear_cache, generate.PromptProcessingBatch.prompt, decode.DecodeBatch.step
        trace = self

        def clear_cache() -> None:
            trace.clears += 1
            if not trace.keep:
                clear()

        def prompting(batch: Any, tokens: Any) -> Any:
            trace._prompts += 1
            if not trace.phases or not tokens:
                return prompt(batch, tokens)
            t0 = time.perf_counter()
            mx.synchronize()  # the decode step in flight
            t1 = time.perf_counter()
            out = prompt(batch, tokens)
            mx.synchronize()
            t2 = time.perf_counter()
            trace.phase["wait_decode"] += t1 - t0
            trace.phase["prompt"] += t2 - t1
            trace.shapes.add((len(tokens), max(len(t) for t in tokens)))
            return out

        for name in ("split", "generate"):
            setattr(
                generate.PromptProcessingBatch, name, self._timed(getattr(generate.PromptProcessingBatch, name), name)
            )
        generate.GenerationBatch.extend = self._timed(generate.GenerationBatch.extend, "extend")
        generate.GenerationBatch.filter = self._timed(generate.GenerationBatch.filter, "filter")

        def stepping(batch: Any) -> Any:
            before, t = self._prompts, time.perf_counter()
            out = step(batch)
            self.steps.append((time.perf_counter() - t, self._prompts - before))
            return out

        generate.mx.clear_cache = clear_cache  # generate.py calls mx.clear_cache(): mx is mlx.core
        generate.PromptProcessingBatch.prompt = prompting
        decode.DecodeBatch.step = stepping

    def _timed(self, fn: Any, name: str) -> Any:
        import mlx.core as mx

        trace = self

        def timed(*a: Any, **k: Any) -> Any:
            if not trace.phases:
                return fn(*a, **k)
            mx.synchronize()
            t = time.perf_counter()
            out = fn(*a, **k)
            mx.synchronize()
            trace.phase[name] += time.perf_counter() - t
            return out

        return timed

    def reset(self, keep: bool, phases: bool = False) -> None:
        self.keep, self.steps, self.clears, self._prompts = keep, [], 0, 0
        self.phases, self.shapes = phases, set()
        self.phase = dict.fromkeys(("wait_decode", "prompt", "split", "generate", "extend", "filter"), 0.0)

    def summary(self) -> dict[str, Any]:
        decode = [s * 1000 for s, p in self.steps if p == 0]
        prompt = [s * 1000 for s, p in self.steps if p > 0]
        return {
            "step_calls": len(self.steps),
            "decode_only_steps": len(decode),
            "decode_only_ms_median": round(statistics.median(decode), 2) if decode else None,
            "decode_only_ms_p90": round(statistics.quantiles(decode, n=10)[-1], 2) if len(decode) > 10 else None,
            "decode_only_s": round(sum(decode) / 1000, 2),
            "prompt_steps": len(prompt),
            "prompt_step_ms_median": round(statistics.median(prompt), 2) if prompt else None,
            "prompt_steps_s": round(sum(prompt) / 1000, 2),
            "clear_cache_calls": self.clears,
            **({f"phase_{k}_s": round(v, 3) for k, v in self.phase.items()} if self.phases else {}),
            **({"prompt_shapes": len(self.shapes)} if self.phases else {}),
        }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--preset", default="dataset", choices=("dataset", "sys6", "twolevel"))
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--prefill-batch-size", type=int, default=8)
    ap.add_argument("--variants", default="base,keep")
    ap.add_argument("--step-iters", type=int, default=20)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    import mlx.core as mx

    from bench.engine.dataset_job import preset_prompts
    from bench.engine.prefix import Workload, run_ours
    from bench.lib.models import load_bench_model
    from bench.lib.steps import own_caches, pipelined_ms
    from omlx_jobs.defaults import Switches
    from omlx_jobs.worker.attention import routing
    from omlx_jobs.worker.attention.kernels import ragged
    from omlx_jobs.worker.attention.options import Routing
    from omlx_jobs.worker.engine.config import EngineConfig

    loaded = load_bench_model(args.model, dtype=args.dtype)
    mx.eval(loaded.model.parameters())
    prompts, max_tokens = preset_prompts(args.preset, loaded.vocab_size, args.scale, seed=0)
    warm_prompts, _ = preset_prompts(args.preset, loaded.vocab_size, args.scale, seed=1)
    rows = min(args.batch_size, len(prompts))
    context = sum(len(p) for p in prompts) // len(prompts) + max_tokens // 2
    dtype = loaded.model.layers[0].self_attn.k_proj.weight.dtype
    trace = Trace()

    def config(prefill: int, old: bool = False) -> EngineConfig:
        return EngineConfig(
            completion_batch_size=args.batch_size,
            prefill_batch_size=prefill,
            **({"prefill_tokens": 0, "refill_rows": 1} if old else {}),
            ignore_eos=True,
            cache_memory=None,
            switches=Switches.from_env(),
        )

    out: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        run_ours(loaded, Workload("warm", warm_prompts, max_tokens=max_tokens), "warm", config(8), Path(tmp))
        caches = own_caches(loaded.model, rows, context, dtype)
        kernel = ragged.ragged_decode if ragged.available() and routing.install(loaded.model) else None
        with routing.active(Routing(ragged=kernel)):
            step_ms = pipelined_ms(
                loaded.model, caches, mx.array([[7]] * rows), [c._idx for c in caches], args.step_iters
            )
        del caches
        print(
            f"model {args.model}; preset {args.preset} x{args.scale}; batch {rows}; isolated step {step_ms:.2f} ms "
            f"at {rows} rows x {context} tokens",
            flush=True,
        )
        for i, variant in enumerate(args.variants.split(",")):
            parts = variant.split("+")
            prefill = next((int(p[2:]) for p in parts if p.startswith("pb")), args.prefill_batch_size)
            trace.reset(keep="keep" in parts, phases="phases" in parts)
            mx.synchronize()
            run = run_ours(
                loaded,
                Workload("job", prompts, max_tokens=max_tokens),
                variant,
                config(prefill, old="old" in parts),
                Path(tmp),
                rep=i,
            )
            row = {"variant": variant, "seconds": round(run.seconds, 2), **run.extra, **trace.summary()}
            med = row["decode_only_ms_median"]
            row["decode_only_over_isolated"] = round(med / step_ms, 2) if med else None
            out.append(row)
            print(json.dumps(row), flush=True)
    cols = (
        "seconds",
        "prefill_s",
        "decode_s",
        "decode_only_ms_median",
        "decode_only_over_isolated",
        "prompt_steps",
        "prompt_step_ms_median",
        "prompt_steps_s",
        "clear_cache_calls",
    )
    print(f"{'variant':12} " + " ".join(f"{c[:14]:>14}" for c in cols))
    for r in out:
        print(f"{r['variant']:12} " + " ".join(f"{r.get(c)!s:>14}" for c in cols))
    if args.json:
        args.json.write_text(json.dumps({"argv": sys.argv, "isolated_step_ms": step_ms, "runs": out}))


if __name__ == "__main__":
    main()
