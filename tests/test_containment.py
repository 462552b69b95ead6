"""A request that makes the engine raise fails alone (issue 10, defect 4): the poison test on real Redis, a real
store, the tiny real model and a real RQ worker, and worker/runtime/containment.py's rules on the engine alone.

The poison is mlx-lm's own sampler with a top_k beyond the vocabulary, put on one request's row through the
test hook (worker/engine/faults.py): it raises ValueError inside mlx-lm's compiled sampler during a step and leaves
the global random state unevaluable, as defect 2 did before validation caught it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
import redis
from mlx_lm.sample_utils import make_sampler

from omlx_jobs.errors import ErrorCode
from omlx_jobs.jobs import actions
from omlx_jobs.jobs.formats import COMPLETIONS_URL, SamplingParams
from omlx_jobs.jobs.queue import queue_name
from omlx_jobs.store import Store, StoreError
from omlx_jobs.worker.engine import faults
from omlx_jobs.worker.engine.config import EngineConfig
from omlx_jobs.worker.engine.contract import Control, Hooks
from omlx_jobs.worker.engine.loop import Engine
from omlx_jobs.worker.engine.results import ItemResult
from omlx_jobs.worker.engine.sequence import WorkItem
from omlx_jobs.worker.models.loaded import LoadedModel
from omlx_jobs.worker.runtime import containment

POISON_TOP_K = 10**6


def poison_rows(*keys: Any) -> None:
    """Make the engine raise for the requests with these keys (every one, with no keys given)."""

    def on_row(work: WorkItem, row: Any) -> None:
        if not keys or work.key in keys:
            row.sampler = make_sampler(temp=1.0, top_k=POISON_TOP_K)

    faults.on_row = on_row


@pytest.fixture(autouse=True)
def no_hook_after() -> Iterator[None]:
    yield
    faults.on_row = None


def sampled_lines(path: Path, n: int, *, max_tokens: int = 2) -> Path:
    with path.open("w") as f:
        for i in range(n):
            line = {"custom_id": f"q{i}", "prompt": f"Once upon a time {i} there", "max_tokens": max_tokens}
            f.write(json.dumps({**line, "temperature": 1.0}) + "\n")
    return path


def serve_burst(store: Store, engine: Engine, conn: redis.Redis, qname: str) -> int:
    from omlx_jobs.worker import entry
    from omlx_jobs.worker.runtime.rq_worker import serve

    entry.install(entry.WorkerContext(store=store, engine=engine, redis=conn, queue=qname))
    try:
        return serve(entry.current(), qname, burst=True, heartbeat_ttl=3)
    finally:
        entry.install(None)


def test_one_poison_request_in_a_shard_of_64_fails_alone_and_the_worker_serves_on(
    tmp_path: Path, redis_url: str, tiny_loaded: LoadedModel, tiny_model_dir: Path
) -> None:
    conn = redis.Redis.from_url(redis_url)
    store = Store(f"sqlite:///{tmp_path / 'jobs.db'}")
    model = str(tiny_model_dir)
    first = actions.submit(store, conn, sampled_lines(tmp_path / "a.jsonl", 64), model).load.job_id
    second = actions.submit(store, conn, sampled_lines(tmp_path / "b.jsonl", 16), model).load.job_id
    assert len(store.shards(first)) == 1
    ids = {r.custom_id: r.id for r in store.iter_requests(first, columns=["id", "custom_id"])}
    poison_rows(ids["q17"])
    engine = Engine(tiny_loaded, EngineConfig(completion_batch_size=8, prefill_batch_size=4))
    assert serve_burst(store, engine, conn, queue_name(model)) == 0

    rows = {r.custom_id: r for r in store.iter_requests(first)}
    bad = rows.pop("q17")
    assert (bad.status, bad.error_code) == ("failed", ErrorCode.ENGINE_ERROR)
    assert "ValueError" in bad.error_message and "top_k" in bad.error_message and "alone" in bad.error_message
    assert {r.status for r in rows.values()} == {"completed"} and len(rows) == 63
    assert {r.attempts for r in rows.values()} == {1}  # the neighbours in its batch were not charged
    counts = store.counts(first)
    assert (store.get_job(first).status, counts.completed, counts.failed) == ("completed", 63, 1)
    # The same worker then ran the next job, sampled too: its MLX state was rebuilt after the poison.
    later = list(store.iter_requests(second))
    assert {r.status for r in later} == {"completed"} and len(later) == 16


def sampled(max_tokens: int = 2) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0)


def items(loaded: LoadedModel, n: int) -> list[WorkItem]:
    return [
        WorkItem(i, loaded.encode(COMPLETIONS_URL, {"prompt": f"The quick brown fox {i}"}), sampled()) for i in range(n)
    ]


def test_containment_refunds_neighbours_and_charges_nobody_twice(tiny_loaded: LoadedModel) -> None:
    engine = Engine(tiny_loaded, EngineConfig(completion_batch_size=4, prefill_batch_size=2))
    charged: dict[Any, int] = {}
    results: dict[Any, ItemResult] = {}

    def on_admit(keys: list[Any]) -> None:
        for k in keys:
            charged[k] = charged.get(k, 0) + 1

    def refund(keys: list[Any]) -> None:
        for k in keys:
            charged[k] -= 1

    poison_rows(3, 9)
    stats = containment.run_contained(
        engine,
        items(tiny_loaded, 20),
        Hooks(lambda rs: results.update({r.key: r for r in rs}), admit=on_admit, refund=refund),
        page_size=5,
    )
    assert sorted(results) == list(range(20)) and stats.unfinished == [] and stats.input_exhausted
    failed = {k for k, r in results.items() if r.error is not None}
    assert failed == {3, 9}
    assert all(results[k].error.code == ErrorCode.ENGINE_ERROR for k in failed)  # type: ignore[union-attr]
    assert {charged[k] for k in results if k not in failed} == {1}


def test_an_engine_that_fails_everything_is_broken_not_its_requests(tiny_loaded: LoadedModel) -> None:
    engine = Engine(tiny_loaded, EngineConfig(completion_batch_size=4, prefill_batch_size=2))
    results: list[ItemResult] = []
    poison_rows()  # every request
    with pytest.raises(containment.EngineBroken, match="in a row"):
        containment.run_contained(engine, items(tiny_loaded, 12), results.extend)
    assert len(results) == containment.MAX_FAILING_IN_A_ROW  # then it stopped blaming requests


def test_the_callers_errors_are_not_contained(tiny_loaded: LoadedModel) -> None:
    engine = Engine(tiny_loaded, EngineConfig(completion_batch_size=4, prefill_batch_size=2))

    def on_results(rs: list[ItemResult]) -> None:
        raise StoreError("disk full")

    with pytest.raises(StoreError, match="disk full"):
        containment.run_contained(engine, items(tiny_loaded, 6), on_results)


def test_rebuild_makes_a_poisoned_random_state_usable(tiny_loaded: LoadedModel) -> None:
    logits = mx.zeros((2, 50))
    with pytest.raises(ValueError, match="top_k"):
        mx.eval(make_sampler(temp=1.0, top_k=POISON_TOP_K)(logits))
    with pytest.raises(RuntimeError, match="without a primitive"):
        mx.eval(make_sampler(temp=1.0)(logits))  # what every later sampled request hit (defect 2)
    containment.rebuild(Engine(tiny_loaded))
    assert make_sampler(temp=1.0)(logits).shape == (2,)


def test_the_shards_timeout_is_not_contained(tiny_loaded: LoadedModel) -> None:
    from rq.timeouts import JobTimeoutException

    engine = Engine(tiny_loaded, EngineConfig(completion_batch_size=4, prefill_batch_size=2))

    def on_row(work: WorkItem, row: Any) -> None:
        if work.key == 2:  # as RQ's alarm would, in the middle of the engine's own code
            raise JobTimeoutException("shard timed out")

    faults.on_row = on_row
    refunded: list[Any] = []
    with pytest.raises(JobTimeoutException):
        containment.run_contained(engine, items(tiny_loaded, 6), Hooks(lambda rs: None, refund=refunded.extend))
    assert refunded == []


def test_a_stop_during_isolation_leaves_the_rest_pending(tiny_loaded: LoadedModel) -> None:
    engine = Engine(tiny_loaded, EngineConfig(completion_batch_size=4, prefill_batch_size=2))
    refunded: list[Any] = []
    results: dict[Any, ItemResult] = {}
    poison_rows(1)
    control = Control.RUN

    def refund(keys: list[Any]) -> None:
        nonlocal control
        refunded.extend(keys)
        control = Control.STOP  # a SIGTERM arrives as the first failure is contained

    stats = containment.run_contained(
        engine,
        items(tiny_loaded, 12),
        Hooks(lambda rs: results.update({r.key: r for r in rs}), control=lambda: control, refund=refund),
        page_size=6,
    )
    assert all(r.error is None for r in results.values())  # nobody was blamed
    assert set(stats.unfinished) >= set(refunded) and 1 in stats.unfinished
    assert not stats.input_exhausted and not set(stats.unfinished) & set(results)
