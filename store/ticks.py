"""Live token counts of running jobs: what each worker prefilled and generated for a job, and when.

A worker running a shard adds its token counts to a row of its own every few seconds (jobs/live.py), and
extends that row until it spans a set share of the job's age; then it starts a new one. So a job keeps about
ROWS_PER_AGE * ln(duration) rows per worker however long it runs, old rows coarser than new ones, and a job's
throughput over time, its current tokens per second and its requests in flight are one index range of this
table (job_id, ended_at), never a read of its requests.

A mixin of Store (store/db.py), which holds the engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import BigInteger, Engine, Float, ForeignKey, Index, Integer, String, insert, select, update
from sqlalchemy.orm import Mapped, mapped_column

from omlx_jobs.store.errors import retrying
from omlx_jobs.store.models import Base


class JobTick(Base):
    """Tokens one worker computed for one job in [started_at, ended_at], and its requests in flight at the end."""

    __tablename__ = "job_ticks"
    __table_args__ = (Index("ix_job_ticks_job_end", "job_id", "ended_at"),)

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    worker: Mapped[str] = mapped_column(String(255))
    started_at: Mapped[float] = mapped_column(Float)
    ended_at: Mapped[float] = mapped_column(Float)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    """Prompt tokens run through the model (warm-ups and uncached suffixes), not the cached ones."""
    completion_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    in_flight: Mapped[int] = mapped_column(Integer, default=0)


@dataclass(frozen=True)
class Tick:
    job_id: str
    worker: str
    started_at: float
    ended_at: float
    prompt_tokens: int
    completion_tokens: int
    in_flight: int

    @property
    def seconds(self) -> float:
        return max(self.ended_at - self.started_at, 0.0)


_COLUMNS = (
    JobTick.job_id,
    JobTick.worker,
    JobTick.started_at,
    JobTick.ended_at,
    JobTick.prompt_tokens,
    JobTick.completion_tokens,
    JobTick.in_flight,
)


class TickStore:
    engine: Engine

    @retrying
    def add_tick(
        self, job_id: str, worker: str, started_at: float, ended_at: float, prompt: int, completion: int, in_flight: int
    ) -> int:
        """A new row of live counts; returns its id (extend_tick adds to it)."""
        with self.engine.begin() as conn:
            result = conn.execute(
                insert(JobTick).values(
                    job_id=job_id,
                    worker=worker,
                    started_at=started_at,
                    ended_at=ended_at,
                    prompt_tokens=prompt,
                    completion_tokens=completion,
                    in_flight=in_flight,
                )
            )
            return int(result.inserted_primary_key[0])

    @retrying
    def extend_tick(self, tick_id: int, ended_at: float, prompt: int, completion: int, in_flight: int) -> None:
        """Add counts to a row and move its end to `ended_at`."""
        with self.engine.begin() as conn:
            conn.execute(
                update(JobTick)
                .where(JobTick.id == tick_id)
                .values(
                    ended_at=ended_at,
                    prompt_tokens=JobTick.prompt_tokens + prompt,
                    completion_tokens=JobTick.completion_tokens + completion,
                    in_flight=in_flight,
                )
            )

    @retrying
    def job_ticks(self, job_id: str, since: float | None = None) -> list[Tick]:
        """The job's rows (those that ended at or after `since`), oldest first."""
        stmt = select(*_COLUMNS).where(JobTick.job_id == job_id)
        if since is not None:
            stmt = stmt.where(JobTick.ended_at >= since)
        with self.engine.connect() as conn:
            rows = conn.execute(stmt.order_by(JobTick.ended_at)).all()
        return [Tick(*r) for r in rows]

    @retrying
    def recent_ticks(self, job_ids: Sequence[str], since: float) -> list[Tick]:
        """Rows of `job_ids` that ended at or after `since` (one index range per job)."""
        if not job_ids:
            return []
        stmt = select(*_COLUMNS).where(JobTick.job_id.in_(list(job_ids)), JobTick.ended_at >= since)
        with self.engine.connect() as conn:
            return [Tick(*r) for r in conn.execute(stmt.order_by(JobTick.ended_at)).all()]


__all__ = ["JobTick", "Tick", "TickStore"]
