"""Multiple-choice scoring: echo with max_tokens 0 through the engine, against a plain mlx-lm forward pass per
(question, answer).

    PYTHONPATH=. .venv/bin/python bench/engine/scoring.py --model gguf:$(.venv/bin/omlx-jobs models smollm2-path)

N questions x 4 answers, completions requests `{"prompt": question + answer, "max_tokens": 0, "echo": true,
"logprobs": 1}`. The engine plans them (the question is a shared prefix: one warm-up scores it, each answer
runs only its own tokens); the plain path runs every (question, answer) prompt through the model from scratch
and takes a log-softmax. Both report wall time and prompt tokens computed, each divided by the trie minimum
(the distinct prompt tokens), and the two answers' logprob sums are compared.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

SUBJECTS = ["capital", "river", "mountain", "painter", "poet", "composer", "island", "desert", "lake", "king"]
ANSWERS = [" Paris", " the Danube", " Mount Everest", " none of the above"]


def questions(n: int) -> list[str]:
    return [
        f"Question {i}: which {SUBJECTS[i % len(SUBJECTS)]} is meant by clue number {i * 7 % 101}, "
        f"given in the old book of riddles on page {i % 13}? Answer:"
        for i in range(n)
    ]


def engine_run(loaded: Any, prompts: list[str], args: argparse.Namespace) -> dict[str, Any]:
    from omlx_jobs.jobs.formats import COMPLETIONS_URL, SamplingParams
    from omlx_jobs.jobs.params import OutputParams
    from omlx_jobs.worker.engine.config import EngineConfig
    from omlx_jobs.worker.engine.loop import Engine
    from omlx_jobs.worker.engine.sequence import WorkItem

    engine = Engine(loaded, EngineConfig(completion_batch_size=args.batch))
    items = []
    for i, p in enumerate(prompts):
        body = {"prompt": p, "max_tokens": 0, "echo": True, "logprobs": 1}
        tokens = loaded.encode(COMPLETIONS_URL, body)
        items.append(WorkItem(i, tokens, SamplingParams.from_body(body), output=OutputParams.from_body(body)))
    sums: dict[int, float] = {}

    def on_results(results: list[Any]) -> None:
        for r in results:
            entries = r.choices[0].prompt_logprobs
            sums[r.key] = sum(e[1] for e in entries[1:])

    engine.outputs.grammar()  # the token pieces, built once per model: not part of a job's time
    t0 = time.perf_counter()
    stats = engine.run(items, on_results)
    wall = time.perf_counter() - t0
    return {
        "wall_s": round(wall, 3),
        "prompt_tokens": stats.prompt_tokens,
        "trie_min_tokens": stats.trie_min_tokens,
        "computed_tokens": stats.prefill_tokens,
        "warmups": stats.warmups,
        "sums": [sums[i] for i in range(len(prompts))],
    }


def plain_run(loaded: Any, prompts: list[str]) -> dict[str, Any]:
    """One forward pass per prompt, as a scorer on mlx-lm alone would: logits -> log-softmax -> sum."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from omlx_jobs.jobs.formats import COMPLETIONS_URL

    encoded = [loaded.encode(COMPLETIONS_URL, {"prompt": p}) for p in prompts]
    t0 = time.perf_counter()
    sums = []
    for tokens in encoded:
        logits = loaded.model(mx.array([tokens]), cache=make_prompt_cache(loaded.model))[0].astype(mx.float32)
        lsm = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        picked = mx.take_along_axis(lsm[:-1], mx.array(tokens[1:])[:, None], axis=-1)
        sums.append(float(picked.sum().item()))
    wall = time.perf_counter() - t0
    return {"wall_s": round(wall, 3), "computed_tokens": sum(len(t) for t in encoded), "sums": sums}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="tiny, or a model reference: gguf:FILE.gguf")
    ap.add_argument("--questions", type=int, default=200)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    import omlx_jobs.worker  # noqa: F401  (OpenBLAS before mlx)
    from bench.lib.models import load_bench_model

    report: dict[str, Any] = {"model": args.model, "args": vars(args) | {"json": str(args.json)}}
    report["load_before"] = os.getloadavg()
    loaded = load_bench_model(args.model)
    prompts = [q + a for q in questions(args.questions) for a in ANSWERS]
    plain_run(loaded, prompts[:8])  # warm-up of both paths, unmeasured
    engine_run(loaded, prompts[:8], args)
    eng = engine_run(loaded, prompts, args)
    plain = plain_run(loaded, prompts)
    trie = eng["trie_min_tokens"]
    diff = max(abs(a - b) for a, b in zip(eng.pop("sums"), plain.pop("sums"), strict=True))
    report |= {
        "engine": eng,
        "plain": plain,
        "max_abs_diff_of_answer_logprob_sums": diff,
        "per_trie_min_token": {
            "engine_computed": round(eng["computed_tokens"] / trie, 3),
            "plain_computed": round(plain["computed_tokens"] / trie, 3),
            "engine_ms": round(1000 * eng["wall_s"] / trie, 3),
            "plain_ms": round(1000 * plain["wall_s"] / trie, 3),
        },
        "speedup": round(plain["wall_s"] / eng["wall_s"], 2),
        "load_after": os.getloadavg(),
    }
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
