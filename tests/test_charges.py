"""cached_tokens counts only the prompt tokens not computed for a request (issue 10, defect 9): with n > 1, one
request reported all of its prompt cached while the job reported the same tokens computed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from omlx_jobs.jobs.formats import COMPLETIONS_URL, SamplingParams
from omlx_jobs.jobs.submit import load_job
from omlx_jobs.store import Store
from omlx_jobs.worker.engine.charges import Charges
from omlx_jobs.worker.engine.config import EngineConfig
from omlx_jobs.worker.engine.loop import Engine
from omlx_jobs.worker.engine.results import ItemResult
from omlx_jobs.worker.engine.sequence import WorkItem
from omlx_jobs.worker.models.loaded import LoadedModel
from omlx_jobs.worker.prompts import token_key
from omlx_jobs.worker.runtime import shard

SYSTEM = "You are a helpful assistant. Answer briefly and clearly, in one sentence please."


def test_a_warm_up_is_charged_to_its_first_user_only() -> None:
    charges = Charges()
    parent, child = token_key(list(range(10))), token_key(list(range(20)))
    charges.computed(parent, 0, 10)
    charges.computed(child, 10, 20)
    prompt = token_key([*range(20), 99, 98])
    assert charges.cached(prompt, 20) == 0  # both warm-ups were computed for it
    assert charges.cached(prompt, 20) == 20  # the next one reuses them
    charges.computed(child, 10, 20)
    other = token_key([*range(12), 7, 7])
    assert charges.cached(other, 12) == 10  # it takes positions 10 and 11 of the child warm-up
    assert charges.cached(prompt, 20) == 12 and len(charges) == 0


@pytest.mark.parametrize("n", [2, 3])
def test_one_request_with_n_choices_is_charged_its_prompt(tiny_loaded: LoadedModel, n: int) -> None:
    engine = Engine(tiny_loaded)
    tokens = tiny_loaded.encode(COMPLETIONS_URL, {"prompt": "Once upon a time there was a fox"})
    results: list[ItemResult] = []
    stats = engine.run([WorkItem(0, tokens, SamplingParams(max_tokens=2, temperature=1.0, n=n))], results.extend)
    (result,) = results
    assert len(result.choices) == n and stats.prefill_tokens == len(tokens)  # computed once, by a warm-up
    assert (result.prompt_tokens, result.cached_tokens) == (len(tokens), 0)


def lines(path: Path) -> Path:
    with path.open("w") as f:
        for i, n in enumerate([2, 1, 3, 2, 1]):
            msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"question {i}"}]
            f.write(json.dumps({"custom_id": f"r{i}", "messages": msgs, "n": n, "max_tokens": 2, "temperature": 1}))
            f.write("\n")
        f.write(json.dumps({"custom_id": "alone", "prompt": "Once upon a time", "n": 2, "max_tokens": 2}) + "\n")
    return path


def test_the_requests_computed_tokens_add_up_to_the_jobs(tmp_path: Path, tiny_loaded: LoadedModel) -> None:
    store = Store(f"sqlite:///{tmp_path / 'jobs.db'}")
    job = load_job(store, lines(tmp_path / "in.jsonl"), "m").job_id
    engine = Engine(tiny_loaded, EngineConfig(min_shared_tokens=4))
    shard.run_shard(store, engine, job)
    rows: dict[str, Any] = {r.custom_id: r for r in store.iter_requests(job)}
    assert {r.status for r in rows.values()} == {"completed"}
    assert rows["alone"].cached_tokens == 0  # the defect: all of its prompt was reported cached
    counts = store.counts(job)
    assert counts.prompt_tokens - counts.cached_tokens == store.get_job(job).prefill_tokens
    assert 0 < counts.cached_tokens < counts.prompt_tokens  # the shared system prompt is cached for all but one
