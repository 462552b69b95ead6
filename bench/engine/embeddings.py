"""Embedding throughput and the cost of keeping vectors, side by side in one run (issue 26).

Throughput (prompt tokens per second) of the embedding engine (worker/embeddings/: length-sorted batches under a
token budget, one forward pass each, no decode, no KV cache kept) against a plain loop over mlx-lm's model one
input at a time (`model.model(ids)`, last-token pooling), and for a BERT against mlx-embeddings' own batch call
(the tokenizer pads, `model(...).text_embeds`, batches in input order). The vectors are checked to agree.

Prefix reuse (`reuse`): inputs that share an instruction prefix (`--prefix-len` tokens, as Qwen3-Embedding's
`Instruct: ...\nQuery:`) before queries of `--query-min`..`--query-max` tokens, through the engine with reuse on
and off, side by side (prompt tokens per second counting every prompt token, computed tokens, vectors compared).

Store and export: N requests of one `--dim` vector each committed as a worker commits them (record_completions,
500 a step) and exported with `results` (float JSON and base64), per 100,000 vectors.

Random weights (`random:SHAPE`) are cut from one pool of random values (bench/lib/models.py's pooled_weights):
a 0.6B shape builds in 1.5-6 s on two CPU cores (30 s drawing every value). `--loop-seconds` bounds the
one-at-a-time loop (on CUDA each new input length builds a cuDNN attention plan, which dominates that loop).

    .venv/bin/python bench/engine/embeddings.py                          # CPU: tiny decoder, tiny BERT, store
    .venv/bin/python bench/engine/embeddings.py --model gguf:... --inputs 256   # SmolLM2-135M
    python3 bench/engine/embeddings.py --model random:qwen3-embedding-0.6b --dtype bfloat16 --inputs 4096 \
        --min-len 32 --max-len 512 --skip bert,store --loop-seconds 15   # on a GPU (the Qwen3-Embedding-0.6B shape)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
# The one-at-a-time loop sees hundreds of distinct lengths: MLX's CUDA backend keeps 256 cuDNN attention plans by
# default and can fail on thrashing; a larger cache helps the loop (our engine pads lengths to a few buckets).
os.environ.setdefault("MLX_CUDA_SDPA_CACHE_SIZE", "2048")

import omlx_jobs.worker  # noqa: F401  fast BLAS before mlx
from bench.lib.models import load_bench_model


def embedding_model(spec: str, dtype: str | None) -> Any:
    """An EmbeddingModel: the tiny test decoder, a model directory or GGUF file, or random weights in a shape."""
    from omlx_jobs.worker.embeddings.model import EmbeddingModel
    from omlx_jobs.worker.embeddings.pooling import EmbeddingConfig

    if spec == "tiny":
        from omlx_jobs.worker.loading import load
        from tests.tiny_embedding import build_tiny_embedding

        return load(str(build_tiny_embedding(Path(tempfile.mkdtemp()) / "tiny", context_length=8192)))
    from mlx_lm.models.cache import make_prompt_cache

    shape = spec.replace("qwen3-embedding-", "qwen3-")  # Qwen3-Embedding-0.6B is Qwen3-0.6B's shape
    loaded = load_bench_model(shape, dtype, init="pool")
    if isinstance(loaded, EmbeddingModel):
        return loaded
    body, model = loaded.model.model, loaded.model
    kw = {f.name: getattr(loaded, f.name) for f in fields(loaded) if f.init and hasattr(loaded, f.name)}
    return EmbeddingModel(
        **kw,
        embedding=EmbeddingConfig("lasttoken", True),
        forward=lambda ids, mask: body(ids),
        dim=int(loaded.config["hidden_size"]),
        extend=lambda ids, caches: body(ids, cache=caches),
        new_cache=lambda: make_prompt_cache(model),
    )


def timed_model(args: argparse.Namespace) -> Any:
    """The model of --model, built once for every section; its build time printed."""
    if getattr(args, "_loaded", None) is None:
        t = time.perf_counter()
        args._loaded = embedding_model(args.model, args.dtype)
        print("build", json.dumps({"model": args.model, "build_s": round(time.perf_counter() - t, 2)}), flush=True)
    return args._loaded


def inputs(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab - 1) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def run_engine(
    loaded: Any, rows: list[list[int]], budget: int, max_rows: int, *, reuse: bool = True, min_shared: int = 16
) -> tuple[float, Any, Any]:
    import mlx.core as mx
    import numpy as np

    from omlx_jobs.store.vectors import StoredVectors
    from omlx_jobs.worker.embeddings.engine import EmbeddingEngine
    from omlx_jobs.worker.embeddings.model import EmbeddingPrompt
    from omlx_jobs.worker.engine.config import EngineConfig
    from omlx_jobs.worker.engine.sequence import WorkItem
    from omlx_jobs.worker.prompts import token_key

    config = EngineConfig(prefix_cache=reuse, min_shared_tokens=min_shared)
    engine = EmbeddingEngine(loaded, config, token_budget=budget, max_rows=max_rows)
    items = [WorkItem(i, r, None, EmbeddingPrompt(r, token_key(r), (), (tuple(r),))) for i, r in enumerate(rows)]  # type: ignore[arg-type]
    got: dict[int, Any] = {}
    mx.synchronize()
    t = time.perf_counter()
    stats = engine.run(items, lambda results: got.update({r.key: r for r in results}), page_size=len(items))
    mx.synchronize()
    seconds = time.perf_counter() - t
    vectors = np.stack([np.array(StoredVectors.decode(got[i].vectors).vector(0)) for i in range(len(rows))])
    stats.cached = sum(r.cached_tokens for r in got.values())
    return seconds, vectors, stats


def run_loop(loaded: Any, rows: list[list[int]], seconds: float | None = None) -> tuple[float, Any]:
    """A plain loop over mlx-lm's model, one input at a time: hidden states, last token, normalized. With
    `seconds`, it stops after the input that passes that time (the vectors say how many it did)."""
    import mlx.core as mx
    import numpy as np

    body = loaded.model.model
    out = []
    mx.synchronize()
    t = time.perf_counter()
    for r in rows:
        v = body(mx.array([r]))[0, -1].astype(mx.float32)
        out.append(v / mx.linalg.norm(v))
        mx.eval(out[-1])
        if seconds is not None and time.perf_counter() - t > seconds:
            break
    return time.perf_counter() - t, np.stack([np.array(v) for v in out])


def bench_decoder(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np

    loaded = timed_model(args)
    rows = inputs(args.inputs, args.min_len, args.max_len, loaded.vocab_size)
    tokens = sum(map(len, rows))
    run_engine(loaded, rows[: min(8, len(rows))], args.budget, args.max_rows)  # warm-ups (compile, buffers), both
    run_loop(loaded, rows[: min(8, len(rows))])
    ours, v_ours, _ = run_engine(loaded, rows, args.budget, args.max_rows)
    again, _, _ = run_engine(loaded, rows, args.budget, args.max_rows)  # its shapes seen once already
    loop, v_loop = run_loop(loaded, rows, args.loop_seconds)
    done = len(v_loop)
    loop_tokens = sum(map(len, rows[:done]))
    diff = float(np.abs(v_ours[:done] - v_loop).max())
    return {
        "model": args.model,
        "inputs": len(rows),
        "tokens": tokens,
        "engine_s": round(ours, 3),
        "engine_again_s": round(again, 3),
        "loop_inputs": done,
        "loop_s": round(loop, 3),
        "engine_tok_s": round(tokens / ours, 1),
        "engine_again_tok_s": round(tokens / again, 1),
        "loop_tok_s": round(loop_tokens / loop, 1),
        "speedup": round(tokens / ours / (loop_tokens / loop), 2),
        "max_abs_diff": diff,
    }


def shared_inputs(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    """Queries behind one instruction prefix of --prefix-len tokens (its ids drawn once)."""
    rng = random.Random(2)
    prefix = [rng.randrange(10, vocab - 1) for _ in range(args.prefix_len)]
    return [prefix + q for q in inputs(args.reuse_inputs or args.inputs, args.query_min, args.query_max, vocab, 3)]


def bench_reuse(args: argparse.Namespace) -> dict[str, Any]:
    """The shared-instruction workload through the engine with prefix reuse on and off, warmed up, run twice
    each in turn (off, on, off, on); the faster run of each is reported."""
    import numpy as np

    loaded = timed_model(args)
    rows = shared_inputs(args, loaded.vocab_size)
    tokens = sum(map(len, rows))
    best: dict[bool, Any] = {}
    for reuse in (False, True):
        run_engine(loaded, rows[:8], args.budget, args.max_rows, reuse=reuse)
    for _ in range(2):
        for reuse in (False, True):
            run = run_engine(loaded, rows, args.budget, args.max_rows, reuse=reuse)
            if reuse not in best or run[0] < best[reuse][0]:
                best[reuse] = run
    (off, v_off, s_off), (on, v_on, s_on) = best[False], best[True]
    return {
        "model": args.model,
        "inputs": len(rows),
        "prefix_len": args.prefix_len,
        "query_len": [args.query_min, args.query_max],
        "tokens": tokens,
        "off_s": round(off, 3),
        "on_s": round(on, 3),
        "off_tok_s": round(tokens / off, 1),
        "on_tok_s": round(tokens / on, 1),
        "speedup": round(off / on, 2),
        "computed_off": s_off.prefill_tokens,
        "computed_on": s_on.prefill_tokens,
        "cached_on": s_on.cached,
        "max_abs_diff": float(np.abs(v_on - v_off).max()),
    }


def bench_bert(args: argparse.Namespace) -> dict[str, Any]:
    """The tiny BERT: our engine against mlx-embeddings' own batch call on texts (batches in input order)."""
    import mlx.core as mx
    import numpy as np

    from omlx_jobs.worker.loading import load
    from tests.tiny_embedding import build_tiny_bert

    loaded = load(str(build_tiny_bert(Path(tempfile.mkdtemp()) / "bert")))
    rng = random.Random(1)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "capital", "paris", "answer", "question"]
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(4, 30))) for _ in range(args.inputs)]
    rows = [loaded.tokenizer.encode(t) for t in texts]
    tokens = sum(map(len, rows))
    run_engine(loaded, rows[:8], args.budget, args.max_rows)
    ours, v_ours, _ = run_engine(loaded, rows, args.budget, args.max_rows)
    out = []
    t = time.perf_counter()
    for i in range(0, len(texts), args.bert_batch):
        batch = loaded.tokenizer(texts[i : i + args.bert_batch], padding=True, return_tensors="np")
        res = loaded.model(mx.array(batch["input_ids"]), attention_mask=mx.array(batch["attention_mask"]))
        mx.eval(res.text_embeds)
        out.append(np.array(res.text_embeds))
    theirs = time.perf_counter() - t
    diff = float(np.abs(v_ours - np.concatenate(out)).max())
    return {
        "model": "tiny-bert",
        "inputs": len(rows),
        "tokens": tokens,
        "engine_tok_s": round(tokens / ours, 1),
        "mlx_embeddings_tok_s": round(tokens / theirs, 1),
        "speedup": round(theirs / ours, 2),
        "max_abs_diff": diff,
    }


def bench_store(args: argparse.Namespace) -> dict[str, Any]:
    """Commit N one-vector results as a worker does, then export them as float JSON and as base64."""
    import numpy as np

    from omlx_jobs.jobs.export import write_results
    from omlx_jobs.jobs.submit import load_job
    from omlx_jobs.store import open_store
    from omlx_jobs.store.rows import CompletionRow
    from omlx_jobs.store.vectors import StoredVectors

    work = Path(tempfile.mkdtemp())
    out: dict[str, Any] = {"vectors": args.store_n, "dim": args.dim}
    for fmt in ("float", "base64"):
        src = work / f"{fmt}.jsonl"
        extra = {"encoding_format": "base64"} if fmt == "base64" else {}
        src.write_text("".join(json.dumps({"input": f"text {i}", **extra}) + "\n" for i in range(args.store_n)))
        db = work / f"{fmt}.db"
        store = open_store(url=f"sqlite:///{db}")
        job = load_job(store, src, "m")
        ids = [r.id for page in store.pending_pages(job.job_id, 0, None) for r in page]
        rng = np.random.default_rng(0)
        before = db.stat().st_size
        t = time.perf_counter()
        for i in range(0, len(ids), 500):
            chunk = ids[i : i + 500]
            vecs = rng.standard_normal((len(chunk), args.dim), dtype=np.float32)
            rows = [
                CompletionRow(
                    rid,
                    "",
                    "embedded",
                    4,
                    0,
                    0,
                    vectors=StoredVectors.from_bytes(1, args.dim, v.tobytes(), base64=fmt == "base64").encode(),
                )
                for rid, v in zip(chunk, vecs, strict=True)
            ]
            store.record_completions(rows)
        stored = time.perf_counter() - t
        t = time.perf_counter()
        write_results(store, job.job_id, work / f"{fmt}.out.jsonl")
        exported = time.perf_counter() - t
        scale = 100_000 / args.store_n
        out[fmt] = {
            "store_s_per_100k": round(stored * scale, 2),
            "export_s_per_100k": round(exported * scale, 2),
            "db_mb_per_100k": round((db.stat().st_size - before) / 1e6 * scale, 1),
            "export_mb_per_100k": round((work / f"{fmt}.out.jsonl").stat().st_size / 1e6 * scale, 1),
        }
        store.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="tiny | PATH | gguf:FILE | random:qwen3-embedding-0.6b")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--inputs", type=int, default=512)
    ap.add_argument("--min-len", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--budget", type=int, default=16384, help="padded tokens per forward pass")
    ap.add_argument("--max-rows", type=int, default=256)
    ap.add_argument("--bert-batch", type=int, default=32)
    ap.add_argument("--store-n", type=int, default=20_000)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--loop-seconds", type=float, default=None, help="stop the one-at-a-time loop after this")
    ap.add_argument("--prefix-len", type=int, default=24, help="reuse: the shared instruction's tokens")
    ap.add_argument("--query-min", type=int, default=4)
    ap.add_argument("--query-max", type=int, default=48)
    ap.add_argument("--reuse-inputs", type=int, default=None, help="reuse: inputs (default --inputs)")
    ap.add_argument("--skip", default="", help="comma list of: decoder, reuse, bert, store")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    report: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
    args._loaded = None
    sections = (("decoder", bench_decoder), ("reuse", bench_reuse), ("bert", bench_bert), ("store", bench_store))
    for name, fn in sections:
        if name not in skip:
            report[name] = fn(args)
            print(name, json.dumps(report[name]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
