"""A SIGTERM while a worker is idle reaches the worker's loop wherever it lands (RQ raises StopRequested there).

RQ's handler raises StopRequested in whatever code the main thread runs when the signal comes. Two places of ours
catch every Exception: the claim of a same-group shard (an optimisation) and the payload check before a shard
starts. A stop that lands there must go on to RQ's loop: swallowed, the worker kept serving after its SIGTERM
(tests/test_faults.py caught it hanging), or refused a good shard. Pure logic: no Redis, no model.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from rq.exceptions import StopRequested

from omlx_jobs.jobs import affinity
from omlx_jobs.worker.runtime.rq_worker import OmlxWorker


def idle_worker() -> Any:
    refused: list[str] = []
    worker = SimpleNamespace(
        context=SimpleNamespace(last_shard=("batch_x", 0), stopping=False, store=None),
        queues=[SimpleNamespace(name="omlx:m")],
        connection=None,
        refused=refused,
        _refuse=lambda job, queue, reason: refused.append(reason),
    )
    return worker


def raising(exc: BaseException) -> Any:
    def fn(*args: Any, **kwargs: Any) -> Any:
        raise exc

    return fn


def test_a_stop_during_the_same_group_claim_reaches_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(affinity, "claim_same_group", raising(StopRequested()))
    with pytest.raises(StopRequested):
        OmlxWorker._claim_same_group(idle_worker())


def test_other_claim_failures_fall_back_to_rqs_dequeue(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(affinity, "claim_same_group", raising(RuntimeError("store hiccup")))
    assert OmlxWorker._claim_same_group(idle_worker()) is None


class Job:
    id = "batch_x--0-10"

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    @property
    def func_name(self) -> str:
        raise self.exc


def test_a_stop_during_the_payload_check_is_not_a_refusal() -> None:
    worker = idle_worker()
    with pytest.raises(StopRequested):
        OmlxWorker.execute_job(worker, Job(StopRequested()), worker.queues[0])
    assert worker.refused == []
    OmlxWorker.execute_job(worker, Job(ValueError("not JSON")), worker.queues[0])  # a bad payload is refused
    assert worker.refused == ["not JSON"]
