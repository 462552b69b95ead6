"""Constrained decoding: grammar compile time per schema, and json_schema throughput against unconstrained.

    .venv/bin/python bench/engine/grammar.py --model gguf:$(.venv/bin/omlx-jobs models smollm2-path) --json out.json

1. Compile: the GrammarTokenizer build (once per model), then each schema of tests/data/schemas/schemas.json
   compiled cold (a GrammarCache miss, first mask included) and cached (a hit: a copy of the compiled matcher).
2. Throughput, on mlx-lm's BatchGenerator directly (phase 2 reruns it through the engine): the same chat
   prompts (extractions into the five schemas, mixed), greedy, batch 32, run
   - unconstrained: no processors;
   - rows: json_schema through per-row logits processors (GrammarProcessor), as BatchGenerator calls them;
   - batched: json_schema through one BatchLogits.apply per decode step, the forward pass dispatched before
     the masks are filled so the two overlap (a GenerationBatch whose step does this; phase 2's backend adapter
     owns that step for real).
   The variants run side by side, a few decode steps each in turn, so load changes hit them alike.
3. The grammar's own cost per step at the batch size, without the model (per-row processors, one call).
4. With --engine: throughput through the real engine (worker/engine.py, as a worker runs a shard): the same
   requests as chat lines without and with their json_schema response_format (masks applied for the whole
   batch in one call per step, and, as json_schema_rows, row by row in mlx-lm's own step), run in rounds whose
   order reverses each time, so load changes reach every variant alike.

On a GPU host without network (wheels staged in /tmp/site: llguidance; jsonschema optional):
    PYTHONPATH=/tmp/site:$PWD python3 bench/engine/grammar.py --model tiny --requests 64 --max-tokens 64
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # bench/ and tests/ as packages

SCHEMAS = json.loads((Path(__file__).resolve().parents[2] / "tests/data/schemas/schemas.json").read_text())["schemas"]
TEXTS = [
    "Ada Lovelace, 36, wrote to ada@example.org about the engine.",
    "The food was wonderful and the staff friendly; we will come back.",
    "Invoice INV-77 for Acme Ltd, 1 High St, Leeds: two widgets at 9.50 each, sent, unpaid.",
    "Gustave Eiffel's tower opened in Paris in 1889 to mixed reviews.",
    "A root node with children a and b, where b has one child b1.",
]


def _load(ref: str) -> Any:
    from bench.lib.models import load_bench_model

    return load_bench_model(ref)


def compile_times(loaded: Any) -> dict[str, Any]:
    from omlx_jobs.jobs.response_format import ResponseFormat
    from omlx_jobs.worker.extras.grammar import GrammarCache, GrammarTokenizer, model_eos_ids

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
    from omlx_jobs.worker.extras.logits import logits_width

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
    from omlx_jobs.worker.extras.logits import BatchLogits, row_logits

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


class Run:
    """One variant's BatchGenerator over all the prompts, advanced a few steps at a time."""

    def __init__(self, loaded: Any, prompts: list[Any], variant: str, args: argparse.Namespace, grammar: Any) -> None:
        import importlib

        from omlx_jobs.jobs.params import OutputParams
        from omlx_jobs.jobs.response_format import ResponseFormat
        from omlx_jobs.worker.extras.logits import BatchLogits, row_logits

        self.mg = importlib.import_module("mlx_lm.generate")  # the module (mlx_lm.generate is also a function)
        self.loaded, self.prompts, self.variant = loaded, prompts, variant
        tok, cache = grammar
        self.eos = tok.eos_ids
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
        by_uid: dict[int, Any] = {}
        self.batch_class = (
            _masked_generation_batch(by_uid, BatchLogits(tok, executor=grammar_executor(args)))
            if variant == "batched"
            else self.mg.GenerationBatch
        )
        with self._patched():
            self.gen = self.mg.BatchGenerator(
                loaded.model, stop_tokens=[[t] for t in sorted(self.eos)], completion_batch_size=args.batch
            )
        processors = [r.processors if (r is not None and variant == "rows") else [] for r in rows]
        self.uids = self.gen.insert(
            [p for p, _ in prompts], max_tokens=[args.max_tokens] * len(prompts), logits_processors=processors
        )
        by_uid.update({u: r for u, r in zip(self.uids, rows, strict=True) if r is not None})
        self.outs: dict[int, list[int]] = {u: [] for u in self.uids}
        self.reasons: dict[int, str] = {}
        self.wall = 0.0
        self._window = self.gen.stats()
        self.stats = self._window.__enter__()

    @contextlib.contextmanager
    def _patched(self) -> Iterator[None]:
        # BatchGenerator builds its GenerationBatch objects from the module's name: only this run sees ours.
        original = self.mg.GenerationBatch
        self.mg.GenerationBatch = self.batch_class
        try:
            yield
        finally:
            self.mg.GenerationBatch = original

    @property
    def done(self) -> bool:
        return len(self.reasons) == len(self.uids)

    def advance(self, steps: int) -> None:
        import mlx.core as mx

        t0 = time.perf_counter()
        with self._patched():
            for _ in range(steps):
                for r in self.gen.next()[1]:
                    if r.token not in self.eos:
                        self.outs[r.uid].append(r.token)
                    if r.finish_reason is not None:
                        self.reasons[r.uid] = r.finish_reason
                if self.done:
                    break
        mx.synchronize()  # its queued work is its own, not the next variant's
        self.wall += time.perf_counter() - t0
        if self.done:
            self._window.__exit__(None, None, None)
            self.gen.close()

    def result(self) -> dict[str, Any]:
        st = self.stats
        return {
            **self._timing(st),
            "valid_json": self._valid(),
            "finish": {k: list(self.reasons.values()).count(k) for k in sorted(set(self.reasons.values()))},
        }

    def _valid(self) -> int | None:
        """Outputs that parse and match their schema; None where jsonschema is not installed (a bare GPU host)."""
        try:
            import jsonschema
        except ImportError:
            return None
        valid = 0
        for u, (_, spec) in zip(self.uids, self.prompts, strict=True):
            try:
                jsonschema.validate(json.loads(self.loaded.tokenizer.decode(self.outs[u])), spec["schema"])
                valid += 1
            except (ValueError, jsonschema.ValidationError):
                pass
        return valid

    def _timing(self, st: Any) -> dict[str, Any]:
        return {
            "wall_s": round(self.wall, 3),
            "prefill_s": round(st.prompt_time, 3),
            "decode_s": round(st.decode_time, 3),
            "decode_steps": st.generation_steps,
            "ms_per_step": round(1000 * st.decode_time / max(st.generation_steps, 1), 2),
            "generated_tokens": st.generation_tokens,
            "decode_tok_per_s": round(st.generation_tokens / max(st.decode_time, 1e-9), 2),
        }


def side_by_side(
    loaded: Any, prompts: list[Any], variants: list[str], args: argparse.Namespace, grammar: Any
) -> dict[str, dict[str, Any]]:
    """All variants at once, each advanced `--chunk` steps in turn (the order rotating), so a change in the
    machine's load reaches every variant alike."""
    runs = {v: Run(loaded, prompts, v, args, grammar) for v in variants}
    turn = 0
    while not all(r.done for r in runs.values()):
        order = variants[turn % len(variants) :] + variants[: turn % len(variants)]
        for v in order:
            if not runs[v].done:
                runs[v].advance(args.chunk)
        turn += 1
    return {v: r.result() for v, r in runs.items()}


def engine_rounds(loaded: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Decode tok/s through the engine, unconstrained against json_schema, over alternating rounds."""
    from omlx_jobs.jobs.formats import CHAT_URL, SamplingParams, parse_line
    from omlx_jobs.jobs.params import OutputParams
    from omlx_jobs.worker.engine.config import EngineConfig
    from omlx_jobs.worker.engine.loop import Engine
    from omlx_jobs.worker.engine.sequence import WorkItem

    config = EngineConfig(completion_batch_size=args.batch, prefix_cache=False, ignore_eos=args.ignore_eos)
    engine = Engine(loaded, config)
    engine.outputs.grammar()  # the grammar tokenizer, once per worker: not part of a job

    def items(constrained: bool) -> list[Any]:
        out = []
        for i in range(args.requests):
            spec = SCHEMAS[i % len(SCHEMAS)]
            messages = [
                {"role": "system", "content": "Reply with one JSON object and nothing else."},
                {"role": "user", "content": f"Extract the {spec['name']} ({i}) as JSON: {TEXTS[i % len(TEXTS)]}"},
            ]
            body: dict[str, Any] = {"messages": messages, "max_tokens": args.max_tokens, "temperature": 0}
            if constrained:
                body["response_format"] = {
                    "type": "json_schema",
                    "json_schema": {"name": "s", "schema": spec["schema"]},
                }
            line = json.dumps({"custom_id": str(i), "method": "POST", "url": CHAT_URL, "body": body})
            b = parse_line(line, 1).body
            tokens = loaded.encode(CHAT_URL, b)
            out.append(WorkItem(i, tokens, SamplingParams.from_body(b), output=OutputParams.from_body(b)))
        return out

    order = args.engine_variants.split(",")
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in order}
    batched = engine.backend.step_logits
    for r in range(args.engine_rounds):
        for variant in order if r % 2 == 0 else order[::-1]:
            # json_schema_rows: the same grammar as per-row processors in mlx-lm's own step (no batch call)
            engine.backend.step_logits = None if variant == "json_schema_rows" else batched
            finishes: list[str] = []

            def on_results(rs: list[Any], finishes: list[str] = finishes) -> None:
                finishes.extend(c.finish_reason for x in rs for c in x.choices)

            stats = engine.run(items(variant != "unconstrained"), on_results)
            runs[variant].append(
                {
                    "decode_s": round(stats.decode_seconds, 3),
                    "tokens": stats.generation_tokens,
                    "decode_tok_per_s": round(stats.generation_tokens / max(stats.decode_seconds, 1e-9), 2),
                    "wall_s": round(stats.seconds, 3),
                    "finish": {k: finishes.count(k) for k in sorted(set(finishes))},
                }
            )
            print(variant, runs[variant][-1], flush=True)
    tps = {v: sum(x["tokens"] for x in rs) / sum(x["decode_s"] for x in rs) for v, rs in runs.items()}
    return {
        "runs": runs,
        "decode_tok_per_s": {v: round(t, 2) for v, t in tps.items()},
        "slowdown_vs_unconstrained": {v: round(1 - t / tps["unconstrained"], 4) for v, t in tps.items()},
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
    ap.add_argument("--chunk", type=int, default=8, help="decode steps a variant runs before the next one's turn")
    ap.add_argument("--variants", default="unconstrained,rows,batched")
    ap.add_argument("--threads", type=int, default=1, help="mask-filling threads for the batched variant")
    ap.add_argument("--mask-steps", type=int, default=200)
    ap.add_argument("--mask-only", action="store_true", help="compile times and the mask cost, no generation")
    ap.add_argument("--engine", action="store_true", help="compile times, then throughput through the engine only")
    ap.add_argument("--engine-rounds", type=int, default=2)
    ap.add_argument("--engine-variants", default="unconstrained,json_schema,json_schema_rows")
    ap.add_argument(
        "--ignore-eos",
        action="store_true",
        help="every request decodes max_tokens (equal batch occupancy in every variant; a finished grammar then "
        "allows only EOS, whose masks are cheap: throughput only)",
    )
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    import omlx_jobs.worker  # noqa: F401  (OpenBLAS before mlx)
    from omlx_jobs.worker.extras.grammar import GrammarCache, GrammarTokenizer, model_eos_ids

    report: dict[str, Any] = {"model": args.model, "args": vars(args) | {"json": str(args.json)}}
    report["load_before"] = os.getloadavg()
    loaded = _load(args.model)
    report["compile"] = compile_times(loaded)
    print(json.dumps(report["compile"], indent=1), flush=True)
    if args.engine:
        report["engine"] = engine_rounds(loaded, args)
        print(json.dumps({k: v for k, v in report["engine"].items() if k != "runs"}), flush=True)
        _write(report, args)
        return
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
    side_by_side(loaded, prompts[: args.batch // 4], variants, args, grammar)  # warm-up, unmeasured
    report["runs"] = side_by_side(loaded, prompts, variants, args, grammar)
    for v, res in report["runs"].items():
        print(f"{v}: {res}", flush=True)
    tps = {v: r["decode_tok_per_s"] for v, r in report["runs"].items()}
    if "unconstrained" in tps:
        report["decode_slowdown_vs_unconstrained"] = {v: round(1 - t / tps["unconstrained"], 4) for v, t in tps.items()}
        base_step = report["runs"]["unconstrained"]["ms_per_step"]
        report["step_time_ratio_vs_unconstrained"] = {
            v: round(r["ms_per_step"] / base_step, 4) for v, r in report["runs"].items()
        }
    print(
        json.dumps({k: report.get(k) for k in ("decode_slowdown_vs_unconstrained", "step_time_ratio_vs_unconstrained")})
    )
    _write(report, args)


def _write(report: dict[str, Any], args: argparse.Namespace) -> None:
    report["load_after"] = os.getloadavg()
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
