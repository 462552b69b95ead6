"""The schema of release 0.1.0, frozen: store/models.py as it was, created with create_all and no Alembic.

The migration tests build a database with it first and upgrade that in place. Never edit it."""

from __future__ import annotations

from typing import Any

from sqlalchemy import JSON, BigInteger, Float, ForeignKey, Index, Integer, String, Text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class RequestStatus:
    """Request states. `pending` may run; the other three are final."""

    PENDING = "pending"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


FINAL_REQUEST_STATUSES = (RequestStatus.COMPLETED, RequestStatus.FAILED, RequestStatus.CANCELLED)


class Base(DeclarativeBase):
    pass


class Job(Base):
    """A submitted batch. Status names follow OpenAI's batch API."""

    __tablename__ = "jobs"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    model: Mapped[str] = mapped_column(String(1024))
    queue: Mapped[str | None] = mapped_column(String(1024), default=None)
    input_file: Mapped[str | None] = mapped_column(Text, default=None)
    status: Mapped[str] = mapped_column(String(32), index=True)
    total: Mapped[int] = mapped_column(Integer, default=0)
    # Submit-time validation errors, when the file was rejected (a bounded list of {line, field, message}).
    errors: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON, default=None)
    options: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    created_at: Mapped[float] = mapped_column(Float)
    in_progress_at: Mapped[float | None] = mapped_column(Float, default=None)
    finalizing_at: Mapped[float | None] = mapped_column(Float, default=None)
    completed_at: Mapped[float | None] = mapped_column(Float, default=None)
    failed_at: Mapped[float | None] = mapped_column(Float, default=None)
    cancelling_at: Mapped[float | None] = mapped_column(Float, default=None)
    cancelled_at: Mapped[float | None] = mapped_column(Float, default=None)
    # Prefix accounting, added to atomically by workers (UPDATE ... SET x = x + n).
    prefill_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    trie_min_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    cache_hits: Mapped[int] = mapped_column(BigInteger, default=0)
    cache_misses: Mapped[int] = mapped_column(BigInteger, default=0)
    cache_evictions: Mapped[int] = mapped_column(BigInteger, default=0)
    cache_peak_bytes: Mapped[int] = mapped_column(BigInteger, default=0)


class Request(Base):
    """One input line. `idx` is its 0-based position in the file's request order; shards are idx ranges."""

    __tablename__ = "requests"
    __table_args__ = (
        Index("ix_requests_job_idx", "job_id", "idx", unique=True),
        Index("ix_requests_job_status", "job_id", "status"),
    )

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    idx: Mapped[int] = mapped_column(Integer)
    line: Mapped[int] = mapped_column(Integer)
    custom_id: Mapped[str] = mapped_column(Text)
    endpoint: Mapped[str] = mapped_column(String(64))
    body: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    status: Mapped[str] = mapped_column(String(16), default=RequestStatus.PENDING)
    output_text: Mapped[str | None] = mapped_column(Text, default=None)
    # Choices after the first, for n > 1: [{"text": ..., "finish_reason": ...}, ...].
    more_choices: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON, default=None)
    finish_reason: Mapped[str | None] = mapped_column(String(16), default=None)
    prompt_tokens: Mapped[int | None] = mapped_column(Integer, default=None)
    cached_tokens: Mapped[int | None] = mapped_column(Integer, default=None)
    completion_tokens: Mapped[int | None] = mapped_column(Integer, default=None)
    error_code: Mapped[str | None] = mapped_column(String(64), default=None)
    error_message: Mapped[str | None] = mapped_column(Text, default=None)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[float] = mapped_column(Float)
    started_at: Mapped[float | None] = mapped_column(Float, default=None)
    finished_at: Mapped[float | None] = mapped_column(Float, default=None)
