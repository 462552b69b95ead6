"""The store's jobs: one row per submitted batch, its status and its prefix-accounting totals.

A mixin of Store (store/db.py), which holds the engine and the url.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, delete, func, insert, select, update

from omlx_jobs.store.errors import JobNotFound, retrying, safe_url
from omlx_jobs.store.models import Job, JobStatus, Request, RequestStatus, Shard, ShardRun


@dataclass(frozen=True)
class JobInfo:
    id: str
    model: str
    model_name: str | None
    queue: str | None
    input_file: str | None
    status: str
    total: int
    errors: list[dict[str, Any]] | None
    options: dict[str, Any]
    created_at: float
    in_progress_at: float | None
    finalizing_at: float | None
    completed_at: float | None
    failed_at: float | None
    cancelling_at: float | None
    cancelled_at: float | None
    submit_lease_until: float | None
    prefill_tokens: int
    trie_min_tokens: int
    cache_hits: int
    cache_misses: int
    cache_evictions: int
    cache_peak_bytes: int


@dataclass(frozen=True)
class JobCounts:
    """Request counts and token totals of one job."""

    total: int
    pending: int
    completed: int
    failed: int
    cancelled: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    first_started_at: float | None
    last_finished_at: float | None

    @property
    def done(self) -> int:
        """Requests with a final status: completed, failed or cancelled."""
        return self.completed + self.failed + self.cancelled


_JOB_COLUMNS = [c.name for c in Job.__table__.columns]


class JobStore:
    url: str
    engine: Engine
    is_sqlite: bool

    @retrying
    def create_job(
        self,
        job_id: str,
        model: str,
        *,
        queue: str | None = None,
        input_file: str | None = None,
        options: dict[str, Any] | None = None,
        status: str = JobStatus.VALIDATING,
        submit_lease_until: float | None = None,
        model_name: str | None = None,
    ) -> None:
        with self.engine.begin() as conn:
            conn.execute(
                insert(Job).values(
                    id=job_id,
                    model=model,
                    model_name=model_name,
                    queue=queue,
                    input_file=input_file,
                    status=status,
                    total=0,
                    options=options or {},
                    created_at=time.time(),
                    submit_lease_until=submit_lease_until,
                    prefill_tokens=0,
                    trie_min_tokens=0,
                    cache_hits=0,
                    cache_misses=0,
                    cache_evictions=0,
                    cache_peak_bytes=0,
                )
            )

    @retrying
    def get_job(self, job_id: str) -> JobInfo:
        with self.engine.connect() as conn:
            row = conn.execute(select(Job.__table__).where(Job.id == job_id)).mappings().first()
        if row is None:
            raise JobNotFound(f"no job {job_id!r} in {safe_url(self.url)}: run `omlx-jobs jobs` to list jobs")
        data = dict(row)
        data["options"] = data.get("options") or {}
        return JobInfo(**data)

    @retrying
    def list_jobs(self, limit: int = 50) -> list[JobInfo]:
        with self.engine.connect() as conn:
            rows = conn.execute(select(Job.__table__).order_by(Job.created_at.desc()).limit(limit)).mappings()
            return [JobInfo(**{**dict(r), "options": r["options"] or {}}) for r in rows]

    @retrying
    def delete_job(self, job_id: str) -> None:
        """Remove a job with its requests, shards and runs (an interrupted submit rolls back this way)."""
        with self.engine.begin() as conn:
            for table in (Request, ShardRun):
                conn.execute(delete(table).where(table.job_id == job_id))
            conn.execute(delete(Job).where(Job.id == job_id))  # shards go with it (ON DELETE CASCADE)

    @retrying
    def update_job(self, job_id: str, **fields: Any) -> None:
        unknown = set(fields) - set(_JOB_COLUMNS)
        if unknown:
            raise ValueError(f"unknown job fields {sorted(unknown)}")
        with self.engine.begin() as conn:
            conn.execute(update(Job).where(Job.id == job_id).values(**fields))

    @retrying
    def transition(self, job_id: str, to_status: str, *, only_from: Iterable[str] | None = None) -> bool:
        """Set the job's status (and its `<status>_at` timestamp) if it is in `only_from`. True if changed."""
        values: dict[str, Any] = {"status": to_status}
        stamp = f"{to_status}_at"
        if stamp in _JOB_COLUMNS:
            values[stamp] = time.time()
        stmt = update(Job).where(Job.id == job_id)
        if only_from is not None:
            stmt = stmt.where(Job.status.in_(list(only_from)))
        with self.engine.begin() as conn:
            return conn.execute(stmt.values(**values)).rowcount > 0

    @retrying
    def renew_submit_lease(self, job_id: str, until: float | None, *, total: int | None = None) -> bool:
        """Push a validating job's submit lease to `until` (None: the file is stored, with `total` requests).
        False if the job is no longer validating: reconcile failed it, and the submit must stop."""
        values: dict[str, Any] = {"submit_lease_until": until}
        if total is not None:
            values["total"] = total
        stmt = update(Job).where(Job.id == job_id, Job.status == JobStatus.VALIDATING).values(**values)
        with self.engine.begin() as conn:
            return conn.execute(stmt).rowcount > 0

    @retrying
    def lapsed_submits(self, queue: str, now: float) -> list[str]:
        """Jobs on `queue` still validating whose submit lease has passed: their submit died."""
        stmt = (
            select(Job.id)
            .where(Job.queue == queue, Job.status == JobStatus.VALIDATING, Job.submit_lease_until.is_not(None))
            .where(Job.submit_lease_until < now)
        )
        with self.engine.connect() as conn:
            return [r[0] for r in conn.execute(stmt)]

    @retrying
    def fail_lapsed_submit(self, job_id: str, now: float, error: dict[str, Any]) -> int | None:
        """Fail a validating job whose lease has passed (or that never had one) and whose file was never stored
        whole (total 0), and drop what its submit stored,
        in one transaction; returns how many request rows it had, or None if it was not such a job."""
        lapsed = (Job.submit_lease_until.is_(None)) | (Job.submit_lease_until < now)
        with self.engine.begin() as conn:
            changed = conn.execute(
                update(Job)
                .where(Job.id == job_id, Job.status == JobStatus.VALIDATING, Job.total == 0, lapsed)
                .values(status=JobStatus.FAILED, failed_at=now, total=0, errors=[error], submit_lease_until=None)
            ).rowcount
            if not changed:
                return None
            stored = conn.execute(select(func.count()).where(Request.job_id == job_id)).scalar_one()
            conn.execute(delete(Request).where(Request.job_id == job_id))
            conn.execute(delete(Shard).where(Shard.job_id == job_id))
            return int(stored)

    @retrying
    def add_job_stats(self, job_id: str, *, peak_bytes: int = 0, **deltas: int) -> None:
        """Add prefix-accounting deltas (prefill_tokens, trie_min_tokens, cache_*) to the job atomically."""
        values: dict[str, Any] = {}
        for name, delta in deltas.items():
            if name not in _JOB_COLUMNS:
                raise ValueError(f"unknown job stat {name}")
            if delta:
                values[name] = getattr(Job, name) + int(delta)
        if peak_bytes:  # SQLite's two-argument max() is other databases' greatest()
            larger = func.max if self.is_sqlite else func.greatest
            values["cache_peak_bytes"] = larger(Job.cache_peak_bytes, int(peak_bytes))
        if values:
            with self.engine.begin() as conn:
                conn.execute(update(Job).where(Job.id == job_id).values(**values))

    @retrying
    def counts(self, job_id: str) -> JobCounts:
        with self.engine.connect() as conn:
            rows = conn.execute(
                select(
                    Request.status,
                    func.count(),
                    func.coalesce(func.sum(Request.prompt_tokens), 0),
                    func.coalesce(func.sum(Request.cached_tokens), 0),
                    func.coalesce(func.sum(Request.completion_tokens), 0),
                    func.min(Request.started_at),
                    func.max(Request.finished_at),
                )
                .where(Request.job_id == job_id)
                .group_by(Request.status)
            ).all()
        by_status = {r[0]: r[1] for r in rows}
        done = [r for r in rows if r[0] == RequestStatus.COMPLETED]
        starts = [r[5] for r in rows if r[5] is not None]
        ends = [r[6] for r in rows if r[6] is not None and r[0] != RequestStatus.PENDING]
        return JobCounts(
            total=sum(by_status.values()),
            pending=by_status.get(RequestStatus.PENDING, 0),
            completed=by_status.get(RequestStatus.COMPLETED, 0),
            failed=by_status.get(RequestStatus.FAILED, 0),
            cancelled=by_status.get(RequestStatus.CANCELLED, 0),
            prompt_tokens=int(sum(r[2] for r in done)),
            cached_tokens=int(sum(r[3] for r in done)),
            completion_tokens=int(sum(r[4] for r in done)),
            first_started_at=min(starts) if starts else None,
            last_finished_at=max(ends) if ends else None,
        )

    @retrying
    def jobs_with_pending(self, queue: str, statuses: Iterable[str]) -> list[str]:
        """Ids of jobs on `queue`, in one of `statuses`, that still have pending requests."""
        pending = select(Request.id).where(Request.job_id == Job.id, Request.status == RequestStatus.PENDING)
        with self.engine.connect() as conn:
            rows = conn.execute(
                select(Job.id).where(Job.queue == queue, Job.status.in_(list(statuses)), pending.exists())
            )
            return [r[0] for r in rows]
