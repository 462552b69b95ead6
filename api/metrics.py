"""/metrics in Prometheus' text format: queue depth, requests completed and failed, tokens per second, the
cache-hit ratio and live workers, read from the store and RQ at scrape time (nothing is counted in-process,
so several servers report the same figures)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from omlx_jobs.api.state import AppState
from omlx_jobs.api.workers import list_workers
from omlx_jobs.jobs import lifecycle
from omlx_jobs.jobs.queue import QUEUE_PREFIX

log = logging.getLogger(__name__)

RATE_WINDOW_SECONDS = 60.0
ACTIVE = [lifecycle.VALIDATING, lifecycle.IN_PROGRESS, lifecycle.FINALIZING, lifecycle.CANCELLING]


class StoreCollector(Collector):
    def __init__(self, state: AppState) -> None:
        self.state = state

    def collect(self) -> Iterator[Metric]:
        reports = self.state.reports
        totals = reports.request_totals()
        for status in ("completed", "failed", "cancelled"):
            c = CounterMetricFamily(f"omlx_requests_{status}", f"Requests {status}, over every job in the store.")
            c.add_metric([], totals.get(status, 0))
            yield c
        pending = GaugeMetricFamily("omlx_requests_pending", "Requests waiting or running, over every job.")
        pending.add_metric([], totals.get("pending", 0))
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
        tps = GaugeMetricFamily(
            "omlx_tokens_per_second",
            f"Tokens of requests finished in the last {RATE_WINDOW_SECONDS:g} s.",
            labels=["kind"],
        )
        tps.add_metric(["prompt"], recent["prompt"] / RATE_WINDOW_SECONDS)
        tps.add_metric(["completion"], recent["completion"] / RATE_WINDOW_SECONDS)
        yield tps
        cached = GaugeMetricFamily(
            "omlx_cached_prompt_tokens_ratio",
            f"Share of prompt tokens served from the prefix cache (requests finished in the last "
            f"{RATE_WINDOW_SECONDS:g} s).",
        )
        cached.add_metric([], recent["cached"] / recent["prompt"] if recent["prompt"] else 0.0)
        yield cached


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
