"""Watching an embeddings job (a real run: the tiny decoder embedding model, a SQLite store, the shard runner that
`omlx-jobs run` and the worker use): while it runs, its status has live prompt tokens per second from the ticks
the embedding engine writes, and an ETA from the prompt tokens left; `status` prints both, and the page's JSON
holds them. Each forward pass is slowed to span a few live ticks; the engine, store and runner are the real ones."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from omlx_jobs.api.config import ServeConfig
from omlx_jobs.api.page import job_view
from omlx_jobs.api.state import AppState
from omlx_jobs.cli.render import status_lines
from omlx_jobs.jobs import throughput
from omlx_jobs.jobs.progress import job_status
from omlx_jobs.jobs.submit import load_job
from omlx_jobs.store import open_store
from omlx_jobs.worker.embeddings.engine import EmbeddingEngine
from omlx_jobs.worker.loading import engine_for, load
from omlx_jobs.worker.runtime import shard
from tests.tiny_embedding import build_tiny_embedding

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "near", "paris"]


def test_a_running_embeddings_job_shows_its_rate_and_eta(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(throughput, "MIN_ESTIMATE_SECONDS", 3.0)  # an ETA after 3 s counted, not 10
    engine = engine_for(load(str(build_tiny_embedding(tmp_path / "m"))))
    assert isinstance(engine, EmbeddingEngine)
    engine.runner.token_budget = 64  # a few inputs a forward pass, each made slow enough to see ticks
    fast = engine.runner.forward

    def slow(ids: Any, mask: Any) -> Any:
        time.sleep(0.25)
        return fast(ids, mask)

    engine.runner.forward = slow
    src = tmp_path / "in.jsonl"
    texts = [" ".join(WORDS[(i + k) % len(WORDS)] for k in range(3 + i % 5)) + f" {i}" for i in range(96)]
    src.write_text("".join(json.dumps({"input": t}) + "\n" for t in texts))
    url = f"sqlite:///{tmp_path / 'jobs.db'}"
    store = open_store(url=url)
    job = load_job(store, src, "tiny-embed")
    seen: list[dict[str, Any]] = []
    started = time.time()

    page = AppState(ServeConfig(db_url=url, redis_url="redis://127.0.0.1:1", files_dir=tmp_path / "files"))

    def progress(n: int) -> None:  # between commits, as `status` and the page would read it from elsewhere
        if time.time() - started > 6 and not seen:
            seen.extend([job_status(store, job.job_id), job_view(page, job.job_id)])

    shard.run_shard(store, engine, job.job_id, on_progress=progress, page_rows=16)
    assert seen, "the run ended before six seconds: nothing to watch"
    s = seen[0]
    assert s["request_counts"]["pending"] > 0 and s["usage"]["completion_tokens"] == 0
    assert s["live"]["prompt_tokens_per_second"] > 0 and s["live"]["generated_tokens_per_second"] == 0
    assert s["eta"]["state"] == "tokens" and s["eta"]["basis"] == "prompt" and s["eta_seconds"] > 0
    assert s["throughput"]["prompt_tokens_per_second"] > 0
    lines = "\n".join(status_lines(s))
    assert "now        prompt" in lines and "embedded tok/s" in lines
    assert "prompt tokens to compute" in lines and "estimating" not in lines and "stalled" not in lines
    view = seen[1]  # the page's JSON for the job (api/page.py): the same figures
    assert view["eta"]["basis"] == "prompt" and view["eta"]["eta_seconds"] > 0 and not view["terminal"]
    assert view["live"]["prompt_tokens_per_second"] > 0 and view["throughput_series"]
    done = job_status(store, job.job_id)
    assert done["request_counts"]["completed"] == len(texts) and done["eta"]["state"] == "done"
    store.close()
