"""Embedding throughput and the cost of keeping vectors, side by side in one run (issue 26).

Throughput (prompt tokens per second) of the embedding engine (worker/embeddings/: length-sorted batches under a
token budget, one forward pass each, no decode, no KV cache kept) against a plain loop over mlx-lm's model one
input at a time (`model.model(ids)`, last-token pooling), and for a BERT against mlx-embeddings' own batch call
(the tokenizer pads, `model(...).text_embeds`, batches in input order). The vectors are checked to agree.

Store and export: N requests of one `--dim` vector each committed as a worker commits them (record_completions,
500 a step) and exported with `results` (float JSON and base64), per 100,000 vectors.

    .venv/bin/python bench/engine/embeddings.py                          # CPU: tiny decoder, tiny BERT, store
    .venv/bin/python bench/engine/embeddings.py --model gguf:... --inputs 256   # SmolLM2-135M
    python3 bench/engine/embeddings.py --model random:qwen3-embedding-0.6b --dtype bfloat16 --inputs 4096 \
        --min-len 32 --max-len 512 --skip bert,store                     # on a GPU (the Qwen3-Embedding-0.6B shape)
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

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
    shape = spec.replace("qwen3-embedding-", "qwen3-")  # Qwen3-Embedding-0.6B is Qwen3-0.6B's shape
    loaded = load_bench_model(shape, dtype)
    if isinstance(loaded, EmbeddingModel):
        return loaded
    body = loaded.model.model
    kw = {f.name: getattr(loaded, f.name) for f in fields(loaded) if f.init and hasattr(loaded, f.name)}
    return EmbeddingModel(
        **kw,
        embedding=EmbeddingConfig("lasttoken", True),
        forward=lambda ids, mask: body(ids),
        dim=int(loaded.config["hidden_size"]),
    )


def inputs(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab - 1) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def run_engine(loaded: Any, rows: list[list[int]], budget: int, max_rows: int) -> tuple[float, Any]:
    import mlx.core as mx
    import numpy as np

    from omlx_jobs.store.vectors import StoredVectors
    from omlx_jobs.worker.embeddings.engine import EmbeddingEngine
    from omlx_jobs.worker.embeddings.model import EmbeddingPrompt
    from omlx_jobs.worker.engine.sequence import WorkItem
    from omlx_jobs.worker.prompts import token_key

    engine = EmbeddingEngine(loaded, token_budget=budget, max_rows=max_rows)
    items = [WorkItem(i, r, None, EmbeddingPrompt(r, token_key(r), (), (tuple(r),))) for i, r in enumerate(rows)]  # type: ignore[arg-type]
    got: dict[int, Any] = {}
    mx.synchronize()
    t = time.perf_counter()
    engine.run(items, lambda results: got.update({r.key: r for r in results}), page_size=len(items))
    mx.synchronize()
    seconds = time.perf_counter() - t
    vectors = np.stack([np.array(StoredVectors.decode(got[i].vectors).vector(0)) for i in range(len(rows))])
    return seconds, vectors


def run_loop(loaded: Any, rows: list[list[int]]) -> tuple[float, Any]:
    """A plain loop over mlx-lm's model, one input at a time: hidden states, last token, normalized."""
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
    seconds = time.perf_counter() - t
    return seconds, np.stack([np.array(v) for v in out])


def bench_decoder(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np

    loaded = embedding_model(args.model, args.dtype)
    rows = inputs(args.inputs, args.min_len, args.max_len, loaded.vocab_size)
    tokens = sum(map(len, rows))
    run_engine(loaded, rows[: min(8, len(rows))], args.budget, args.max_rows)  # warm-ups (compile, buffers), both
    run_loop(loaded, rows[: min(8, len(rows))])
    ours, v_ours = run_engine(loaded, rows, args.budget, args.max_rows)
    loop, v_loop = run_loop(loaded, rows)
    diff = float(np.abs(v_ours - v_loop).max())
    return {
        "model": args.model,
        "inputs": len(rows),
        "tokens": tokens,
        "engine_s": round(ours, 3),
        "loop_s": round(loop, 3),
        "engine_tok_s": round(tokens / ours, 1),
        "loop_tok_s": round(tokens / loop, 1),
        "speedup": round(loop / ours, 2),
        "max_abs_diff": diff,
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
    ours, v_ours = run_engine(loaded, rows, args.budget, args.max_rows)
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
    ap.add_argument("--skip", default="", help="comma list of: decoder, bert, store")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    report: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
    for name, fn in (("decoder", bench_decoder), ("bert", bench_bert), ("store", bench_store)):
        if name not in skip:
            report[name] = fn(args)
            print(name, json.dumps(report[name]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
