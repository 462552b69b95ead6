"""SQLAlchemy 2 tables: one row per job, one row per request line."""

from __future__ import annotations

from enum import Enum
from typing import Any

from sqlalchemy import JSON, BigInteger, Float, ForeignKey, Index, Integer, LargeBinary, String, Text, func
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from omlx_jobs.store.textcodec import SafeText


class RequestStatus(str, Enum):
    """Request states. `pending` may run; the other three are final. A member equals its value (`"pending"`), so
    the column stores the same text and a status read back as a plain str compares equal to its member."""

    PENDING = "pending"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class JobStatus(str, Enum):
    """Job states, OpenAI's names for a batch's status (jobs/lifecycle.py moves jobs between them). Kept here, beside
    RequestStatus, because the store (the lowest layer) writes some of them itself and every layer may import it."""

    VALIDATING = "validating"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"
    EXPIRED = "expired"
    """A batch created through the API whose completion window passed before it finished (`serve` sweeps it)."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


FINAL_REQUEST_STATUSES = (RequestStatus.COMPLETED, RequestStatus.FAILED, RequestStatus.CANCELLED)


class Base(DeclarativeBase):
    pass


class Job(Base):
    """A submitted batch. Status names follow OpenAI's batch API."""

    __tablename__ = "jobs"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    model: Mapped[str] = mapped_column(String(1024))
    # Its short name (jobs/model_names.py); NULL for jobs older than the column: the name is derived from `model`.
    model_name: Mapped[str | None] = mapped_column(String(255), default=None)
    queue: Mapped[str | None] = mapped_column(String(1024), default=None)
    input_file: Mapped[str | None] = mapped_column(Text, default=None)
    status: Mapped[str] = mapped_column(String(32), index=True)
    total: Mapped[int] = mapped_column(Integer, default=0)
    # Submit-time validation errors, when the file was rejected (a bounded list of {line, field, message}).
    errors: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON, default=None)
    options: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    created_at: Mapped[float] = mapped_column(Float, index=True)
    in_progress_at: Mapped[float | None] = mapped_column(Float, default=None)
    finalizing_at: Mapped[float | None] = mapped_column(Float, default=None)
    completed_at: Mapped[float | None] = mapped_column(Float, default=None)
    failed_at: Mapped[float | None] = mapped_column(Float, default=None)
    cancelling_at: Mapped[float | None] = mapped_column(Float, default=None)
    cancelled_at: Mapped[float | None] = mapped_column(Float, default=None)
    # While a submit stores the file, it keeps pushing this forward (jobs/lease.py); NULL once stored whole.
    submit_lease_until: Mapped[float | None] = mapped_column(Float, default=None)
    # Prefix accounting, added to atomically by workers (UPDATE ... SET x = x + n).
    prefill_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    trie_min_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    cache_hits: Mapped[int] = mapped_column(BigInteger, default=0)
    cache_misses: Mapped[int] = mapped_column(BigInteger, default=0)
    cache_evictions: Mapped[int] = mapped_column(BigInteger, default=0)
    cache_peak_bytes: Mapped[int] = mapped_column(BigInteger, default=0)


class Request(Base):
    """One input line. `idx` is its 0-based position in the file (results come back in idx order). Prefix
    order is (sort_key, idx): requests sharing a prompt prefix are adjacent in it, and a shard is a range of
    it. The database sorts by the index; no row is rewritten to number it."""

    __tablename__ = "requests"
    __table_args__ = (
        Index("ix_requests_job_idx", "job_id", "idx", unique=True),
        # Counts by status, and a shard's pending requests as one index range: (job, "pending", first..end).
        Index("ix_requests_job_status_key", "job_id", "status", "sort_key", "idx"),
        # The page's requests table: one status, or one outcome (a finish reason or an error code), in input
        # order as one index range; and a custom_id search (store/requests_page.py).
        Index("ix_requests_job_status_idx", "job_id", "status", "idx"),
        Index("ix_requests_job_custom_id", "job_id", "custom_id"),
    )

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    idx: Mapped[int] = mapped_column(Integer)
    line: Mapped[int] = mapped_column(Integer)
    custom_id: Mapped[str] = mapped_column(SafeText)
    endpoint: Mapped[str] = mapped_column(String(64))
    body: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    status: Mapped[str] = mapped_column(String(16), default=RequestStatus.PENDING)
    # Model output and error text may hold NUL: SafeText stores it on every backend (store/textcodec.py).
    output_text: Mapped[str | None] = mapped_column(SafeText, default=None)
    # Choices after the first, for n > 1: [{"text": ..., "finish_reason": ...}, ...].
    more_choices: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON, default=None)
    finish_reason: Mapped[str | None] = mapped_column(String(16), default=None)
    # Logprobs when asked for (logprobs, echo), in worker/logprobs.py's stored form; NULL otherwise.
    logprobs: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    # Per choice, when the model thought or called tools: reasoning_content, tool_calls, reasoning_tokens.
    chat_extras: Mapped[list[dict[str, Any] | None] | None] = mapped_column(JSON, default=None)
    # An embeddings request's vectors as float32 bytes (store/vectors.py); NULL for every other request.
    vectors: Mapped[bytes | None] = mapped_column(LargeBinary, default=None)
    prompt_tokens: Mapped[int | None] = mapped_column(Integer, default=None)
    cached_tokens: Mapped[int | None] = mapped_column(Integer, default=None)
    completion_tokens: Mapped[int | None] = mapped_column(Integer, default=None)
    error_code: Mapped[str | None] = mapped_column(String(64), default=None)
    error_message: Mapped[str | None] = mapped_column(SafeText, default=None)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[float] = mapped_column(Float)
    started_at: Mapped[float | None] = mapped_column(Float, default=None)
    finished_at: Mapped[float | None] = mapped_column(Float, default=None)
    # The prefix-order key of submit (jobs/sharding.py): compact chunk hashes of the canonical prompt text;
    # empty for invalid lines and rows from release 0.1.0 (they keep file order).
    sort_key: Mapped[bytes | None] = mapped_column(LargeBinary, default=b"")  # never NULL in practice
    # The shard run (worker and model) that produced the result.
    run_id: Mapped[int | None] = mapped_column(Integer, default=None)


outcome_expr = func.coalesce(Request.error_code, Request.finish_reason)
"""How a request ended: its error code (failed; batch_expired for an expired batch's cancelled rows), else its
finish reason (stop, length); NULL while pending and for a plain cancel."""
Index("ix_requests_job_outcome_idx", Request.job_id, outcome_expr, Request.idx)


class Shard(Base):
    """A contiguous range of a job's prefix order: the unit a worker takes from the queue.

    first_pos / end_pos number it among the job's requests at submit (its RQ message carries them); its
    requests are those with (sort_key, idx) in [(first_key, first_idx), (end_key, end_idx)).

    group_first / group_last number the prefix groups of its first and last request (a group is a run of
    requests sharing at least one key chunk); lead_rows / tail_rows count the requests of those groups in it.
    A worker records the shard's trie minimum and the common token prefixes of those two groups once, so the
    job's minimum subtracts what adjacent shards share (ShardStore.record_shard_plan).
    """

    __tablename__ = "shards"
    __table_args__ = (Index("ix_shards_job_first", "job_id", "first_pos", unique=True),)

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    first_pos: Mapped[int] = mapped_column(Integer)
    end_pos: Mapped[int] = mapped_column(Integer)
    first_key: Mapped[bytes] = mapped_column(LargeBinary)
    first_idx: Mapped[int] = mapped_column(Integer)
    end_key: Mapped[bytes] = mapped_column(LargeBinary)
    end_idx: Mapped[int] = mapped_column(Integer)
    group_first: Mapped[int] = mapped_column(Integer, default=0)
    group_last: Mapped[int] = mapped_column(Integer, default=0)
    lead_rows: Mapped[int] = mapped_column(Integer, default=0)
    tail_rows: Mapped[int] = mapped_column(Integer, default=0)
    trie_min_tokens: Mapped[int | None] = mapped_column(BigInteger, default=None)
    lead_tokens: Mapped[bytes | None] = mapped_column(LargeBinary, default=None)
    tail_tokens: Mapped[bytes | None] = mapped_column(LargeBinary, default=None)
    # Runs that failed before any of its requests started (planning, a bad row): bounded, see worker/shard.py.
    failures: Mapped[int] = mapped_column(Integer, default=0)
    last_error: Mapped[str | None] = mapped_column(SafeText, default=None)


class ShardRun(Base):
    """One worker's run of one shard: who ran it, on which model, and how many requests it finished."""

    __tablename__ = "shard_runs"
    __table_args__ = (Index("ix_shard_runs_job", "job_id"),)

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    first_pos: Mapped[int] = mapped_column(Integer)
    end_pos: Mapped[int | None] = mapped_column(Integer, default=None)
    worker: Mapped[str] = mapped_column(String(255))
    model: Mapped[str] = mapped_column(String(1024))
    started_at: Mapped[float] = mapped_column(Float)
    finished_at: Mapped[float | None] = mapped_column(Float, default=None)
    completed: Mapped[int] = mapped_column(Integer, default=0)
    failed: Mapped[int] = mapped_column(Integer, default=0)
    outcome: Mapped[str] = mapped_column(String(32), default="running")
    error: Mapped[str | None] = mapped_column(SafeText, default=None)
