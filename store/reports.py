"""Read-only queries for the web page and /metrics: the job list, outcomes, token histograms, first errors,
totals, and throughput over time for jobs without live counts (store/ticks.py has theirs).

Each is one statement over an index range of one job (or of the listed jobs), never a scan of the table.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Integer, cast, exists, func, literal, or_, select, union_all

from omlx_jobs.store import statements as st
from omlx_jobs.store.batches import BatchRow
from omlx_jobs.store.errors import retrying
from omlx_jobs.store.jobs import JobInfo
from omlx_jobs.store.models import Job, Request, RequestStatus, outcome_expr

HISTOGRAM_STEP = 8
"""Token counts are grouped in steps of this many in SQL; the page merges the steps into its bins."""
_TOP = "\U0010ffff"


@dataclass(frozen=True)
class JobFilter:
    status: str | None = None
    model: str | None = None
    """A model's short name or its --model string."""
    id_prefix: str | None = None
    owner: str | None = None
    """Only jobs this API key may see: not a batch another key created (api/tenants.py); None: every job."""


@dataclass(frozen=True)
class Bucket:
    """Requests that finished in [start, start + seconds)."""

    start: float
    seconds: float
    completed: int
    prompt_tokens: int
    completion_tokens: int

    @property
    def prompt_tokens_per_second(self) -> float:
        return self.prompt_tokens / self.seconds

    @property
    def completion_tokens_per_second(self) -> float:
        return self.completion_tokens / self.seconds


def bucket_seconds(span: float, max_buckets: int) -> float:
    """A round bucket width (1, 2, 5, 10, 15, 30 s, 1, 2, 5, 10, 15, 30 min, hours) giving at most max_buckets."""
    for width in (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600):
        if span / width <= max_buckets:
            return float(width)
    return 3600.0 * math.ceil(span / 3600 / max_buckets)


class Reports:
    def __init__(self, store: Any) -> None:
        self.store = store
        self.url = store.url
        self.engine = store.engine

    @retrying
    def throughput(self, job_id: str, max_buckets: int = 60) -> list[Bucket]:
        """Prompt and generated tokens per second over the job's life, in equal time buckets (SQL GROUP BY).

        Buckets with nothing finished are included as zeros, so a plot shows stalls as stalls.
        """
        done = (Request.job_id == job_id, Request.status == RequestStatus.COMPLETED)
        with self.engine.connect() as conn:
            first, last = conn.execute(
                select(
                    func.min(func.coalesce(Request.started_at, Request.finished_at)), func.max(Request.finished_at)
                ).where(*done)
            ).one()
            if first is None or last is None:
                return []
            width = bucket_seconds(max(last - first, 1.0), max_buckets)
            offset = (Request.finished_at - first) / width
            # SQLite truncates a cast toward zero (offsets are >= 0, so that is floor); PostgreSQL rounds it.
            key = cast(offset, Integer) if self.store.is_sqlite else cast(func.floor(offset), Integer)
            rows = conn.execute(
                select(
                    key.label("k"),
                    func.count(),
                    func.coalesce(func.sum(Request.prompt_tokens), 0),
                    func.coalesce(func.sum(Request.completion_tokens), 0),
                )
                .where(*done)
                .group_by(key)
                .order_by(key)
            ).all()
        by_key = {int(r[0]): r for r in rows}
        n = int((last - first) // width) + 1
        out = []
        for k in range(min(n, max_buckets + 1)):
            r = by_key.get(k)
            out.append(
                Bucket(first + k * width, width, int(r[1]) if r else 0, int(r[2]) if r else 0, int(r[3]) if r else 0)
            )
        return out

    def iter_with_status(
        self, job_id: str, statuses: Sequence[str], columns: Sequence[str], batch_size: int = 2000
    ) -> Iterator[Any]:
        """Rows of a job in one of `statuses`, in input order, as named tuples: an error file skips the completed
        rows in SQL instead of decoding them. Pages are idx ranges, as in Store.iter_requests (and for its reason)."""
        table = Request.__table__
        cols = [table.c[name] for name in columns]
        row_type = st.row_type(tuple(c.name for c in cols))
        first, last = self._bounds(job_id)
        if first is None or last is None:
            return
        for lo in range(first, last + 1, batch_size):
            yield from map(row_type._make, self._page(job_id, list(statuses), lo, lo + batch_size, cols))

    @retrying
    def _bounds(self, job_id: str) -> tuple[int | None, int | None]:
        with self.engine.connect() as conn:
            first, last = conn.execute(
                select(func.min(Request.idx), func.max(Request.idx)).where(Request.job_id == job_id)
            ).one()
        return first, last

    @retrying
    def _page(self, job_id: str, statuses: list[str], lo: int, hi: int, cols: list[Any]) -> list[Any]:
        with self.engine.connect() as conn:
            return conn.execute(
                select(*cols)
                .where(Request.job_id == job_id, Request.idx >= lo, Request.idx < hi, Request.status.in_(statuses))
                .order_by(Request.idx)
            ).all()

    @retrying
    def first_errors(self, job_id: str, limit: int = 10) -> list[dict[str, Any]]:
        """The first failed requests in input order: line, custom_id, code, message."""
        stmt = (
            select(Request.line, Request.custom_id, Request.error_code, Request.error_message)
            .where(Request.job_id == job_id, Request.status == RequestStatus.FAILED)
            .order_by(Request.idx)
            .limit(limit)
        )
        with self.engine.connect() as conn:
            return [{"line": r[0], "custom_id": r[1], "code": r[2], "message": r[3]} for r in conn.execute(stmt).all()]

    @retrying
    def request_totals(self) -> dict[str, int]:
        """Request counts by status, over every job."""
        with self.engine.connect() as conn:
            rows = conn.execute(select(Request.status, func.count()).group_by(Request.status)).all()
        return {r[0]: int(r[1]) for r in rows}

    @retrying
    def job_totals(self) -> dict[str, Any]:
        """Jobs by status, and the prefix cache's hits and misses summed over jobs."""
        with self.engine.connect() as conn:
            by_status = {r[0]: int(r[1]) for r in conn.execute(select(Job.status, func.count()).group_by(Job.status))}
            hits, misses = conn.execute(
                select(func.coalesce(func.sum(Job.cache_hits), 0), func.coalesce(func.sum(Job.cache_misses), 0))
            ).one()
        return {"by_status": by_status, "cache_hits": int(hits), "cache_misses": int(misses)}

    @retrying
    def recent_tokens(self, job_ids: list[str], since: float) -> dict[str, int]:
        """Tokens of requests of `job_ids` that finished after `since` (for a tokens-per-second rate)."""
        if not job_ids:
            return {"prompt": 0, "cached": 0, "completion": 0, "requests": 0}
        stmt = select(
            func.count(),
            func.coalesce(func.sum(Request.prompt_tokens), 0),
            func.coalesce(func.sum(Request.cached_tokens), 0),
            func.coalesce(func.sum(Request.completion_tokens), 0),
        ).where(Request.job_id.in_(job_ids), Request.status == RequestStatus.COMPLETED, Request.finished_at >= since)
        with self.engine.connect() as conn:
            n, prompt, cached, completion = conn.execute(stmt).one()
        return {"prompt": int(prompt), "cached": int(cached), "completion": int(completion), "requests": int(n)}

    @retrying
    def active_jobs(self, statuses: list[str], finished_since: float | None = None) -> list[str]:
        """Jobs in one of `statuses`, plus those that ended after `finished_since`."""
        cond = Job.status.in_(statuses)
        if finished_since is not None:
            ended = (Job.completed_at >= finished_since) | (Job.cancelled_at >= finished_since)
            cond = cond | ended
        with self.engine.connect() as conn:
            return [r[0] for r in conn.execute(select(Job.id).where(cond))]

    @retrying
    def jobs_page(self, where: JobFilter, *, before: tuple[float, str] | None = None, limit: int = 50) -> list[JobInfo]:
        """Up to `limit` jobs matching `where`, newest first, older than `before` (created_at, id): an index
        range of jobs.created_at (or of the id, searching)."""
        stmt = select(Job.__table__)
        if where.status:
            stmt = stmt.where(Job.status == where.status)
        if where.model:
            stmt = stmt.where(or_(Job.model_name == where.model, Job.model == where.model))
        if where.id_prefix:
            stmt = stmt.where(Job.id >= where.id_prefix, Job.id < where.id_prefix + _TOP)
        if where.owner is not None:
            theirs = select(BatchRow.job_id).where(
                BatchRow.job_id == Job.id, BatchRow.owner.is_not(None), BatchRow.owner != where.owner
            )
            stmt = stmt.where(~exists(theirs))
        if before is not None:
            at, job_id = before
            stmt = stmt.where(or_(Job.created_at < at, (Job.created_at == at) & (Job.id < job_id)))
        stmt = stmt.order_by(Job.created_at.desc(), Job.id.desc()).limit(limit)
        with self.engine.connect() as conn:
            rows = conn.execute(stmt).mappings().all()
        return [JobInfo(**{**dict(r), "options": r["options"] or {}}) for r in rows]

    @retrying
    def job_models(self, recent: int = 500) -> list[str]:
        """The short names of the models of the latest `recent` jobs (the job list's model filter)."""
        latest = select(Job.model_name, Job.model).order_by(Job.created_at.desc()).limit(recent).subquery()
        with self.engine.connect() as conn:
            rows = conn.execute(select(latest.c.model_name, latest.c.model).distinct()).all()
        return sorted({r[0] or r[1] for r in rows})

    @retrying
    def status_counts(self, job_ids: Sequence[str]) -> dict[str, dict[str, int]]:
        """Requests by status of each job, from the (job_id, status, idx) index alone."""
        if not job_ids:
            return {}
        stmt = (
            select(Request.job_id, Request.status, func.count())
            .where(Request.job_id.in_(list(job_ids)))
            .group_by(Request.job_id, Request.status)
        )
        out: dict[str, dict[str, int]] = {j: {} for j in job_ids}
        with self.engine.connect() as conn:
            for job_id, status, n in conn.execute(stmt):
                out[job_id][status] = int(n)
        return out

    @retrying
    def outcomes(self, job_id: str) -> dict[str, int]:
        """How the job's finished requests ended: finish reasons (stop, length) and error codes, with counts."""
        stmt = (
            select(outcome_expr, func.count())
            .where(Request.job_id == job_id, outcome_expr.is_not(None))
            .group_by(outcome_expr)
        )
        with self.engine.connect() as conn:
            return {r[0]: int(r[1]) for r in conn.execute(stmt)}

    @retrying
    def token_steps(self, job_id: str) -> dict[str, dict[int, int]]:
        """Completed requests by prompt tokens and by completion tokens, in steps of HISTOGRAM_STEP: {"prompt":
        {step: count}, "completion": {...}} (one statement, two passes over the job's completed range)."""
        done = (Request.job_id == job_id, Request.status == RequestStatus.COMPLETED)
        parts = [
            select(literal(kind).label("kind"), (cast(column, Integer) // HISTOGRAM_STEP).label("step"), func.count())
            .where(*done, column.is_not(None))
            .group_by("step")
            for kind, column in (("prompt", Request.prompt_tokens), ("completion", Request.completion_tokens))
        ]
        out: dict[str, dict[int, int]] = {"prompt": {}, "completion": {}}
        with self.engine.connect() as conn:
            for kind, step, n in conn.execute(union_all(*parts)):
                out[kind][int(step)] = int(n)
        return out

    @retrying
    def sample_bodies(self, job_id: str, limit: int = 200) -> list[dict[str, Any]]:
        """The bodies of the job's first `limit` requests (an idx range): what the ETA reads max_tokens from."""
        stmt = (
            select(Request.body)
            .where(Request.job_id == job_id, Request.idx < limit, Request.body.is_not(None))
            .order_by(Request.idx)
        )
        with self.engine.connect() as conn:
            return [r[0] for r in conn.execute(stmt) if isinstance(r[0], dict)]


__all__ = ["Bucket", "JobFilter", "Reports", "bucket_seconds"]
