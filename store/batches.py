"""The batches table: what the OpenAI Batch API adds to a job created through `serve`.

One row per API batch, keyed by its job id. A separate table rather than new columns on `jobs` (migration
0003_api only adds tables). The job row stays the source of truth for status,
counts and timestamps; this row holds the input file, endpoint, completion window, metadata, expiry and the
output/error file ids set at finalization.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import JSON, Float, ForeignKey, Integer, String, insert, or_, select, update
from sqlalchemy.orm import Mapped, mapped_column

from omlx_jobs.errors import ErrorCode
from omlx_jobs.store.errors import retrying
from omlx_jobs.store.models import Base, Job, Request, RequestStatus

EXPIRED_CODE = ErrorCode.BATCH_EXPIRED
EXPIRED_MESSAGE = "this request could not be run before the batch's completion window expired"


class BatchRow(Base):
    __tablename__ = "batches"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    input_file_id: Mapped[str] = mapped_column(String(64), index=True)
    endpoint: Mapped[str] = mapped_column(String(64))
    completion_window: Mapped[str] = mapped_column(String(16))
    # The model as the file named it (body.model); the job's `model` is the served model it resolved to.
    model_name: Mapped[str | None] = mapped_column(String(1024), default=None)
    # `metadata` is taken by SQLAlchemy's declarative base, so the attribute has another name.
    meta: Mapped[dict[str, Any] | None] = mapped_column("metadata", JSON, default=None)
    created_at: Mapped[float] = mapped_column(Float)
    expires_at: Mapped[float] = mapped_column(Float, index=True)
    expired_at: Mapped[float | None] = mapped_column(Float, default=None)
    # Seconds after their creation that the output and error files expire (output_expires_after).
    output_expires_after: Mapped[int | None] = mapped_column(Integer, default=None)
    output_file_id: Mapped[str | None] = mapped_column(String(64), default=None)
    error_file_id: Mapped[str | None] = mapped_column(String(64), default=None)
    # When the output/error file ids were set; None while the job runs.
    finalized_at: Mapped[float | None] = mapped_column(Float, default=None)
    # The API key that created it (api/tenants.py: a hash, never the key); NULL: visible to every key.
    owner: Mapped[str | None] = mapped_column(String(64), default=None, index=True)


@dataclass(frozen=True)
class BatchInfo:
    job_id: str
    input_file_id: str
    endpoint: str
    completion_window: str
    model_name: str | None
    meta: dict[str, Any] | None
    created_at: float
    expires_at: float
    expired_at: float | None
    output_expires_after: int | None
    output_file_id: str | None
    error_file_id: str | None
    finalized_at: float | None
    owner: str | None = None


def _info(row: Any) -> BatchInfo:
    data = dict(row)
    data["meta"] = data.pop("metadata")
    return BatchInfo(**data)


class Batches:
    """Reads and writes of the batches table, through a Store's engine."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.url = store.url
        self.engine = store.engine

    @retrying
    def add(self, **fields: Any) -> None:
        fields.setdefault("created_at", time.time())
        if "meta" in fields:
            fields["metadata"] = fields.pop("meta")
        with self.engine.begin() as conn:
            conn.execute(insert(BatchRow.__table__).values(**fields))

    @retrying
    def get(self, job_id: str) -> BatchInfo | None:
        with self.engine.connect() as conn:
            row = conn.execute(select(BatchRow.__table__).where(BatchRow.job_id == job_id)).mappings().first()
        return _info(row) if row else None

    @retrying
    def page(self, *, after: str | None, limit: int, owner: str | None = None) -> list[BatchInfo]:
        """Up to `limit` batches, newest first (ids sort by creation time), starting past `after`; with `owner`,
        only that owner's batches and those without one."""
        stmt = select(BatchRow.__table__)
        if owner is not None:
            stmt = stmt.where(or_(BatchRow.owner == owner, BatchRow.owner.is_(None)))
        if after:
            stmt = stmt.where(BatchRow.job_id < after)
        with self.engine.connect() as conn:
            rows = conn.execute(stmt.order_by(BatchRow.job_id.desc()).limit(limit)).mappings()
            return [_info(r) for r in rows]

    @retrying
    def finalize(self, job_id: str, output_file_id: str | None, error_file_id: str | None, now: float) -> None:
        """Set the output/error file ids, once."""
        with self.engine.begin() as conn:
            conn.execute(
                update(BatchRow)
                .where(BatchRow.job_id == job_id, BatchRow.finalized_at.is_(None))
                .values(output_file_id=output_file_id, error_file_id=error_file_id, finalized_at=now)
            )

    @retrying
    def mark_expired(self, job_id: str, now: float) -> None:
        with self.engine.begin() as conn:
            conn.execute(
                update(BatchRow).where(BatchRow.job_id == job_id, BatchRow.expired_at.is_(None)).values(expired_at=now)
            )

    @retrying
    def expire_pending(self, job_id: str, now: float) -> int:
        """Mark the job's pending requests cancelled with code batch_expired; returns how many. Finished ones stay."""
        with self.engine.begin() as conn:
            return conn.execute(
                update(Request)
                .where(Request.job_id == job_id, Request.status == RequestStatus.PENDING)
                .values(
                    status=RequestStatus.CANCELLED,
                    error_code=EXPIRED_CODE,
                    error_message=EXPIRED_MESSAGE,
                    finished_at=now,
                )
            ).rowcount

    @retrying
    def due(self, now: float, statuses: list[str], limit: int = 100) -> list[str]:
        """Job ids of batches past their expires_at whose job is still in one of `statuses`."""
        stmt = (
            select(BatchRow.job_id)
            .join(Job, Job.id == BatchRow.job_id)
            .where(BatchRow.expires_at <= now, Job.status.in_(statuses))
            .limit(limit)
        )
        with self.engine.connect() as conn:
            return [r[0] for r in conn.execute(stmt)]

    @retrying
    def unfinalized(self, statuses: list[str], limit: int = 100) -> list[str]:
        """Job ids of batches whose job ended (one of `statuses`) but whose output files are not set yet."""
        stmt = (
            select(BatchRow.job_id)
            .join(Job, Job.id == BatchRow.job_id)
            .where(BatchRow.finalized_at.is_(None), Job.status.in_(statuses))
            .limit(limit)
        )
        with self.engine.connect() as conn:
            return [r[0] for r in conn.execute(stmt)]


__all__ = ["EXPIRED_CODE", "EXPIRED_MESSAGE", "BatchInfo", "BatchRow", "Batches"]
