"""cached_tokens counts only the prompt tokens not computed for a request (issue 10, defect 9): with n > 1, one
request reported all of its prompt cached while the job reported the same tokens computed."""

from __future__ import annotations

import json
import random
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


def _simulate(rng: random.Random) -> tuple[int, int]:
    """Random prompts over a small alphabet (a bushy trie); warm-ups at random shared prefixes, each computed from
    its deepest warmed ancestor or, with none, from position 0 (two siblings then each compute their shared root:
    issue 21, 12); each request reuses its deepest warm-up. Returns (tokens charged to requests, computed)."""
    prompts = list({tuple(rng.randrange(3) for _ in range(rng.randint(2, 10))) for _ in range(rng.randint(2, 14))})
    shared = {p[:n] for p in prompts for n in range(1, len(p) + 1) if sum(q[:n] == p[:n] for q in prompts) > 1}
    chosen = sorted(rng.sample(sorted(shared), rng.randint(0, len(shared))), key=len)
    charges, computed = Charges(), 0
    for node in chosen:
        start = max((len(a) for a in chosen if len(a) < len(node) and node[: len(a)] == a), default=0)
        charges.computed(token_key(node), start, len(node))
        computed += len(node) - start
    charged = 0
    for p in rng.sample(prompts, len(prompts)):
        reused = max((len(a) for a in chosen if p[: len(a)] == a), default=0)
        cached = charges.cached(token_key(p), reused)
        assert 0 <= cached <= reused
        charged += reused - cached
    assert len(charges) == 0  # every warm-up was charged to someone
    return charged, computed


def test_the_requests_charges_add_up_to_the_warm_ups_over_random_tries() -> None:
    rng = random.Random(12)
    for _ in range(2000):
        charged, computed = _simulate(rng)
        assert charged == computed


def test_two_warm_ups_sharing_a_short_root_are_charged_once_each() -> None:
    """The issue's shape: warm-ups of "root Describe" and "root What is", each computed from 0."""
    charges = Charges()
    describe, what = token_key([1, 2, 3, 10, 11]), token_key([1, 2, 3, 20, 21, 22])
    charges.computed(describe, 0, 5)
    charges.computed(what, 0, 6)
    assert charges.cached(token_key([1, 2, 3, 10, 11, 40]), 5) == 0  # it computed its own warm-up, no other
    assert charges.cached(token_key([1, 2, 3, 20, 21, 22, 41]), 6) == 0
    assert charges.cached(token_key([1, 2, 3, 10, 11, 42]), 5) == 5 and len(charges) == 0


ISSUE_LINES = ["Describe the ocean.", "What is gravity?", "What is a volcano?", "Describe a rainbow."]


@pytest.mark.parametrize("minimum", [4, 16, 32])  # 32: over the tiny tokenizer's root (30), under both pairs
def test_the_issues_four_lines_add_up(tmp_path: Path, tiny_loaded: LoadedModel, minimum: int) -> None:
    src = tmp_path / "in.jsonl"
    with src.open("w") as f:
        for i, user in enumerate(ISSUE_LINES):
            msgs = [{"role": "system", "content": "Reply in exactly one sentence."}, {"role": "user", "content": user}]
            f.write(json.dumps({"custom_id": f"r{i}", "messages": msgs, "max_tokens": 8, "temperature": 0}) + "\n")
    store = Store(f"sqlite:///{tmp_path / 'jobs.db'}")
    job = load_job(store, src, "m").job_id
    shard.run_shard(store, Engine(tiny_loaded, EngineConfig(min_shared_tokens=minimum)), job)
    rows = list(store.iter_requests(job))
    assert {r.status for r in rows} == {"completed"}
    computed = sum(r.prompt_tokens - r.cached_tokens for r in rows)
    assert computed == store.get_job(job).prefill_tokens
