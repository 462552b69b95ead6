"""Constrained decoding: grammar compile time per schema, and json_schema throughput against unconstrained.

    .venv/bin/python bench/grammar.py --model gguf:$(.venv/bin/omlx-jobs models smollm2-path) --json out.json

1. Compile: the GrammarTokenizer build (once per model), then each schema of tests/data/schemas/schemas.json
   compiled cold (a GrammarCache miss, first mask included) and cached (a hit: a copy of the compiled matcher).
2. Throughput, on mlx-lm's BatchGenerator directly (phase 2 reruns it through the engine): the same chat
   prompts (extractions into the five schemas, mixed), greedy, batch 32, run
   - unconstrained: no processors;
   - rows: json_schema through per-row logits processors (GrammarProcessor), as BatchGenerator calls them;
   - batched: json_schema through one BatchLogits.apply per decode step, the forward pass dispatched before
     the masks are filled so the two overlap (a GenerationBatch whose step does this; phase 2's backend adapter
     owns that step for real).
   Variants alternate within each round, so load changes hit them alike. Read tok/s and the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

SCHEMAS = json.loads((Path(__file__).parent.parent / "tests/data/schemas/schemas.json").read_text())["schemas"]
TEXTS = [
    "Ada Lovelace, 36, wrote to ada@example.org about the engine.",
    "The food was wonderful and the staff friendly; we will come back.",
    "Invoice INV-77 for Acme Ltd, 1 High St, Leeds: two widgets at 9.50 each, sent, unpaid.",
    "Gustave Eiffel's tower opened in Paris in 1889 to mixed reviews.",
    "A root node with children a and b, where b has one child b1.",
]


def _load(ref: str) -> Any:
    from bench.models import load_bench_model

    return load_bench_model(ref)


def compile_times(loaded: Any) -> dict[str, Any]:
    from omlx_jobs.jobs.response_format import ResponseFormat
    from omlx_jobs.worker.grammar import GrammarCache, GrammarTokenizer, model_eos_ids

    vocab = _vocab(loaded)
    t0 = time.perf_counter()
    tok = GrammarTokenizer.build(loaded.tokenizer, vocab, model_eos_ids(loaded.tokenizer, loaded.config, vocab))
    build = time.perf_counter() - t0
    cache = GrammarCache(tok)
    out: dict[str, Any] = {"tokenizer_build_ms": round(build * 1000, 2), "schemas": {}}
    for spec in SCHEMAS:
        fmt = ResponseFormat("json_schema", json.dumps(spec["schema"]))
        t0 = time.perf_counter()
        cache.constraint(fmt)
        cold = time.perf_counter() - t0
        hits = []
        for _ in range(20):
            t0 = time.perf_counter()
            cache.constraint(fmt)
            hits.append(time.perf_counter() - t0)
        out["schemas"][spec["name"]] = {"cold_ms": round(cold * 1000, 3), "cached_ms": round(min(hits) * 1000, 4)}
    return out


def _vocab(loaded: Any) -> int:
    from omlx_jobs.worker.logits import logits_width

    return logits_width(loaded.model)


def _prompts(loaded: Any, n: int) -> list[tuple[list[int], dict[str, Any]]]:
    from omlx_jobs.jobs.formats import CHAT_URL

    out = []
    for i in range(n):
        spec = SCHEMAS[i % len(SCHEMAS)]
        messages = [
            {"role": "system", "content": "Reply with one JSON object and nothing else."},
            {"role": "user", "content": f"Extract the {spec['name']} ({i}) as JSON: {TEXTS[i % len(TEXTS)]}"},
        ]
        out.append((loaded.encode(CHAT_URL, {"messages": messages}), spec))
    return out


def mask_step_cost(tok: Any, cache: Any, batch: int, steps: int, executor: Any) -> dict[str, float]:
    """The grammar's own cost per decode step at `batch` rows, without the model: rows stepping through their
    schemas' examples, masked by per-row processors and by one BatchLogits call, on random logits."""
    import mlx.core as mx
    import numpy as np

    from omlx_jobs.jobs.params import OutputParams
    from omlx_jobs.jobs.response_format import ResponseFormat
    from omlx_jobs.worker.logits import BatchLogits, row_logits

    specs = [SCHEMAS[i % len(SCHEMAS)] for i in range(batch)]
    docs = [tok.ll.tokenize_str(json.dumps(s["example"], separators=(",", ":"))) for s in specs]

    def rows(batched: bool) -> list[Any]:
        out = OutputParams
        return [
            row_logits(out(response_format=ResponseFormat("json_schema", json.dumps(s["schema"]))),
                       grammars=cache, vocab_size=tok.vocab_size, batched=batched)
            for s in specs
        ]  # fmt: skip

    per_row, batched_rows, masker = rows(False), rows(True), BatchLogits(tok, executor)
    contexts = [[0] for _ in specs]
    logits = mx.array(np.random.default_rng(0).normal(size=(batch, tok.vocab_size)).astype(np.float32))
    mx.eval(logits)
    times: dict[str, list[float]] = {"rows": [], "batched": []}
    for step in range(steps):
        t0 = time.perf_counter()
        outs = []
        for i, (r, ctx) in enumerate(zip(per_row, contexts, strict=True)):
            x = logits[i : i + 1]
            for p in r.processors:
                x = p(mx.array(ctx), x)
            outs.append(x)
        mx.eval(mx.concatenate(outs))
        times["rows"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        mx.eval(masker.apply(logits, batched_rows, [c[-1] if step else None for c in contexts]))
        times["batched"].append(time.perf_counter() - t0)
        for i, d in enumerate(docs):
            k = len(contexts[i]) - 1
            if k >= len(d):  # a finished document: start the row over
                per_row[i], batched_rows[i], contexts[i] = rows(False)[i], rows(True)[i], [0]
                continue
            contexts[i].append(d[k])
    return {k: round(1000 * statistics.mean(v), 3) for k, v in times.items()}


def _masked_generation_batch(rows: dict[int, Any], batch_logits: Any) -> type:
    """A GenerationBatch whose step masks every row in one call (greedy; the shape of phase 2's adapter step)."""
    import mlx.core as mx
    from mlx_lm.generate import GenerationBatch

    started: set[int] = set()

    class MaskedGenerationBatch(GenerationBatch):  # type: ignore[misc]
        def _step(self):  # type: ignore[no-untyped-def]
            self._current_tokens = self._next_tokens
            self._current_logprobs = self._next_logprobs
            inputs = self._current_tokens
            logits = self.model(inputs[:, None], cache=self.prompt_cache)[:, -1, :]
            row_states = [rows.get(u) for u in self.uids]
            if any(r is not None for r in row_states):
                mx.async_eval(logits)  # the forward pass runs while the masks are filled
                last = inputs.tolist()
                new = [t if u in started else None for u, t in zip(self.uids, last, strict=True)]
                started.update(self.uids)
                logits = batch_logits.apply(logits, row_states, new)
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            self._next_tokens = mx.argmax(logprobs, axis=-1)
            self._next_logprobs = list(logprobs)
            mx.async_eval(self._next_tokens, self._next_logprobs)
            mx.eval(inputs, self._current_logprobs)
            inputs = inputs.tolist()
            for sti, ti in zip(self.tokens, inputs, strict=True):
                sti.append(ti)
            return inputs, self._current_logprobs

    return MaskedGenerationBatch


def run_variant(
    loaded: Any, prompts: list[Any], variant: str, args: argparse.Namespace, grammar: Any
) -> dict[str, Any]:
    """Generate for every prompt in one BatchGenerator; time it, count tokens, check the JSON outputs."""
    import importlib

    import jsonschema

    from omlx_jobs.jobs.params import OutputParams
    from omlx_jobs.jobs.response_format import ResponseFormat
    from omlx_jobs.worker.logits import BatchLogits, row_logits

    mg = importlib.import_module("mlx_lm.generate")  # the module: mlx_lm.generate is also a function's name
    tok, cache = grammar
    rows = [
        row_logits(
            OutputParams(response_format=ResponseFormat("json_schema", json.dumps(spec["schema"]))),
            grammars=cache,
            vocab_size=tok.vocab_size,
            batched=variant == "batched",
        )
        if variant != "unconstrained"
        else None
        for _, spec in prompts
    ]
    original = mg.GenerationBatch
    by_uid: dict[int, Any] = {}
    if variant == "batched":
        mg.GenerationBatch = _masked_generation_batch(by_uid, BatchLogits(tok, executor=grammar_executor(args)))
    try:
        gen = mg.BatchGenerator(
            loaded.model,
            stop_tokens=[[t] for t in sorted(tok.eos_ids)],
            completion_batch_size=args.batch,
            prefill_batch_size=8,
        )
        processors = [r.processors if (r is not None and variant == "rows") else [] for r in rows]
        stats_window = gen.stats()
        stats = stats_window.__enter__()
        t0 = time.perf_counter()
        uids = gen.insert(
            [p for p, _ in prompts], max_tokens=[args.max_tokens] * len(prompts), logits_processors=processors
        )
        by_uid.update({u: r for u, r in zip(uids, rows, strict=True) if r is not None})
        outs: dict[int, list[int]] = {u: [] for u in uids}
        reasons: dict[int, str] = {}
        while len(reasons) < len(uids):
            for r in gen.next()[1]:
                if r.token not in tok.eos_ids:
                    outs[r.uid].append(r.token)
                if r.finish_reason is not None:
                    reasons[r.uid] = r.finish_reason
        wall = time.perf_counter() - t0
        stats_window.__exit__(None, None, None)
        gen.close()
    finally:
        mg.GenerationBatch = original
    generated = sum(len(o) + (reasons[u] == "stop") for u, o in outs.items())
    valid = 0
    for u, (_, spec) in zip(uids, prompts, strict=True):
        try:
            jsonschema.validate(json.loads(loaded.tokenizer.decode(outs[u])), spec["schema"])
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return {
        "wall_s": round(wall, 3),
        "prefill_s": round(stats.prompt_time, 3),
        "decode_s": round(stats.decode_time, 3),
        "decode_steps": stats.generation_steps,
        "ms_per_step": round(1000 * stats.decode_time / max(stats.generation_steps, 1), 2),
        "generated_tokens": generated,
        "tok_per_s": round(generated / wall, 2),
        "decode_tok_per_s": round(stats.generation_tokens / max(stats.decode_time, 1e-9), 2),
        "valid_json": valid,
        "finish": {k: list(reasons.values()).count(k) for k in sorted(set(reasons.values()))},
    }


def grammar_executor(args: argparse.Namespace) -> Any:
    import llguidance

    return llguidance.LLExecutor(num_threads=args.threads) if args.threads > 1 else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="tiny (the test model), or a model reference: gguf:FILE.gguf")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--variants", default="unconstrained,rows,batched")
    ap.add_argument("--threads", type=int, default=1, help="mask-filling threads for the batched variant")
    ap.add_argument("--mask-steps", type=int, default=200)
    ap.add_argument("--mask-only", action="store_true", help="compile times and the mask cost, no generation")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    import omlx_jobs.worker  # noqa: F401  (OpenBLAS before mlx)
    from omlx_jobs.worker.grammar import GrammarCache, GrammarTokenizer, model_eos_ids

    report: dict[str, Any] = {"model": args.model, "args": vars(args) | {"json": str(args.json)}}
    report["load_before"] = os.getloadavg()
    loaded = _load(args.model)
    report["compile"] = compile_times(loaded)
    print(json.dumps(report["compile"], indent=1), flush=True)
    vocab = _vocab(loaded)
    tok = GrammarTokenizer.build(loaded.tokenizer, vocab, model_eos_ids(loaded.tokenizer, loaded.config, vocab))
    grammar = (tok, GrammarCache(tok))
    report["mask_ms_per_step"] = mask_step_cost(tok, grammar[1], args.batch, args.mask_steps, grammar_executor(args))
    print("mask ms per step (no model):", report["mask_ms_per_step"], flush=True)
    if args.mask_only:
        _write(report, args)
        return

    prompts = _prompts(loaded, args.requests)
    variants = args.variants.split(",")
    run_variant(loaded, prompts[: args.batch // 4], "rows", args, grammar)  # warm-up, unmeasured
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    for rnd in range(args.rounds):
        for v in variants if rnd % 2 == 0 else variants[::-1]:
            res = run_variant(loaded, prompts, v, args, grammar)
            runs[v].append(res)
            print(f"round {rnd} {v}: {res}", flush=True)
    summary = {v: statistics.median(r["decode_tok_per_s"] for r in rs) for v, rs in runs.items()}
    base = summary.get("unconstrained")
    report["runs"] = runs
    report["decode_tok_per_s_median"] = summary
    report["ms_per_step_median"] = {v: statistics.median(r["ms_per_step"] for r in rs) for v, rs in runs.items()}
    if base:
        report["slowdown_vs_unconstrained"] = {v: round(1 - s / base, 4) for v, s in summary.items()}
    print(
        json.dumps(
            {
                k: report[k]
                for k in ("decode_tok_per_s_median", "ms_per_step_median", "slowdown_vs_unconstrained")
                if k in report
            }
        )
    )
    _write(report, args)


def _write(report: dict[str, Any], args: argparse.Namespace) -> None:
    report["load_after"] = os.getloadavg()
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
