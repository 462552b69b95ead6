"""/metrics in Prometheus' text format: queue depth, requests completed and failed, tokens per second now (from
the live token counts of running jobs, per job and per worker), requests in flight, the cache-hit ratio and live
workers, read from the store, the workers' records and RQ at scrape time (nothing is counted in-process, so
several servers report the same figures)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from omlx_jobs.api.state import AppState
from omlx_jobs.jobs import lifecycle
from omlx_jobs.jobs.progress import model_name
from omlx_jobs.jobs.queue import QUEUE_PREFIX
from omlx_jobs.jobs.throughput import RATE_WINDOW_SECONDS as LIVE_WINDOW
from omlx_jobs.jobs.throughput import STALE_SECONDS, Current, current
from omlx_jobs.jobs.workers import WorkerInfo, list_workers
from omlx_jobs.store.models import FINAL_REQUEST_STATUSES, RequestStatus

log = logging.getLogger(__name__)

RATE_WINDOW_SECONDS = 60.0
ACTIVE = [lifecycle.VALIDATING, lifecycle.IN_PROGRESS, lifecycle.FINALIZING, lifecycle.CANCELLING]


class StoreCollector(Collector):
    def __init__(self, state: AppState) -> None:
        self.state = state

    def collect(self) -> Iterator[Metric]:
        reports = self.state.reports
        totals = reports.request_totals()
        for status in FINAL_REQUEST_STATUSES:
            c = CounterMetricFamily(f"omlx_requests_{status}", f"Requests {status}, over every job in the store.")
            c.add_metric([], totals.get(status, 0))
            yield c
        pending = GaugeMetricFamily("omlx_requests_pending", "Requests waiting or running, over every job.")
        pending.add_metric([], totals.get(RequestStatus.PENDING, 0))
        yield pending

        jobs = reports.job_totals()
        by_status = GaugeMetricFamily("omlx_jobs", "Jobs by status.", labels=["status"])
        for status in lifecycle.STATUSES:
            by_status.add_metric([status], jobs["by_status"].get(status, 0))
        yield by_status
        lookups = jobs["cache_hits"] + jobs["cache_misses"]
        ratio = GaugeMetricFamily(
            "omlx_prefix_cache_hit_ratio", "Prefix-cache lookups that hit, over every job (hits / (hits + misses))."
        )
        ratio.add_metric([], jobs["cache_hits"] / lookups if lookups else 0.0)
        yield ratio

        now = time.time()  # request rows carry the store's wall-clock times
        active = reports.active_jobs(ACTIVE, finished_since=now - RATE_WINDOW_SECONDS)
        recent = reports.recent_tokens(active, now - RATE_WINDOW_SECONDS)
        finished = GaugeMetricFamily(
            "omlx_finished_tokens_per_second",
            f"Tokens of requests finished in the last {RATE_WINDOW_SECONDS:g} s.",
            labels=["kind"],
        )
        finished.add_metric(["prompt"], recent["prompt"] / RATE_WINDOW_SECONDS)
        finished.add_metric(["completion"], recent["completion"] / RATE_WINDOW_SECONDS)
        yield finished
        cached = GaugeMetricFamily(
            "omlx_cached_prompt_tokens_ratio",
            f"Share of prompt tokens served from the prefix cache (requests finished in the last "
            f"{RATE_WINDOW_SECONDS:g} s).",
        )
        cached.add_metric([], recent["cached"] / recent["prompt"] if recent["prompt"] else 0.0)
        yield cached
        yield from self._live(active, now)

    def _live(self, active: list[str], now: float) -> Iterator[Metric]:
        """Tokens per second now and requests in flight, of every running job and in all (store/ticks.py)."""
        store = self.state.store
        ticks = store.recent_ticks(active, now - LIVE_WINDOW - STALE_SECONDS)
        by_job: dict[str, Current] = {}
        for job_id in sorted({t.job_id for t in ticks}):
            by_job[job_id] = current([t for t in ticks if t.job_id == job_id], now)
        names = {j: model_name(store.get_job(j)) for j in by_job}
        tps = GaugeMetricFamily("omlx_tokens_per_second", "Tokens computed per second now, in all.", labels=["kind"])
        job_tps = GaugeMetricFamily(
            "omlx_job_tokens_per_second", "Tokens computed per second now, by job.", labels=["job", "model", "kind"]
        )
        flight = GaugeMetricFamily("omlx_requests_in_flight", "Requests in the workers' engines now, in all.")
        job_flight = GaugeMetricFamily(
            "omlx_job_requests_in_flight", "Requests in the workers' engines now, by job.", labels=["job", "model"]
        )
        for kind, attr in (("prompt", "prompt_tokens_per_second"), ("generated", "generated_tokens_per_second")):
            tps.add_metric([kind], sum(getattr(c, attr) for c in by_job.values()))
            for job_id, c in by_job.items():
                job_tps.add_metric([job_id, names[job_id], kind], getattr(c, attr))
        flight.add_metric([], sum(c.in_flight for c in by_job.values()))
        for job_id, c in by_job.items():
            job_flight.add_metric([job_id, names[job_id]], c.in_flight)
        yield from (tps, job_tps, flight, job_flight)


class QueueCollector(Collector):
    def __init__(self, state: AppState) -> None:
        self.state = state

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("omlx_redis_up", "1 when Redis answered this scrape.")
        try:
            redis = self.state.redis
            workers = list_workers(redis)
            depths = _queue_depths(redis)
        except Exception as exc:
            log.warning("metrics: Redis unreachable: %s", exc)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        depth = GaugeMetricFamily("omlx_queue_depth", "Shard messages waiting in each queue.", labels=["queue"])
        for name, n in sorted(depths.items()):
            depth.add_metric([name], n)
        yield depth
        alive = GaugeMetricFamily("omlx_workers_alive", "Workers registered in Redis, by state.", labels=["state"])
        states: dict[str, int] = {}
        for w in workers:
            states[w.state] = states.get(w.state, 0) + 1
        for state in sorted({"idle", "busy", *states}):
            alive.add_metric([state], states.get(state, 0))
        yield alive
        yield from _worker_rates(workers)


def _worker_rates(workers: list[WorkerInfo]) -> Iterator[Metric]:
    """Each live worker's tokens per second now and requests in flight, from its record (jobs/workers.py)."""
    tps = GaugeMetricFamily(
        "omlx_worker_tokens_per_second", "A worker's tokens per second now.", labels=["worker", "model", "kind"]
    )
    flight = GaugeMetricFamily(
        "omlx_worker_requests_in_flight", "Requests in a worker's engine now.", labels=["worker", "model"]
    )
    for w in workers:
        tps.add_metric([w.name, w.model_name, "prompt"], w.prompt_tokens_per_second)
        tps.add_metric([w.name, w.model_name, "generated"], w.tokens_per_second)
        flight.add_metric([w.name, w.model_name], w.in_flight)
    yield from (tps, flight)


def _queue_depths(redis: Any) -> dict[str, int]:
    from rq import Queue
    from rq.serializers import JSONSerializer

    return {
        q.name: q.count
        for q in Queue.all(connection=redis, serializer=JSONSerializer)
        if q.name.startswith(QUEUE_PREFIX)
    }


def registry_for(state: AppState) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StoreCollector(state))
    registry.register(QueueCollector(state))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
