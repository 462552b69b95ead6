"""The files table: uploaded batch input files and the output/error files of finished batches.

An input file's bytes live on disk under the server's own folder, named by its id (api/ owns the folder);
an output or error file has no bytes of its own: its content is streamed from the job's request rows.
New table, no change to an existing one (migration 0003_api).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import JSON, BigInteger, Float, Index, Integer, String, Text, delete, insert, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Mapped, mapped_column

from omlx_jobs.store.errors import retrying
from omlx_jobs.store.models import Base

INPUT = "input"
OUTPUT = "output"
ERRORS = "error"


class FileRow(Base):
    """One file object. `kind` is input (uploaded), output or error (of the batch `job_id`)."""

    __tablename__ = "files"
    __table_args__ = (
        # One output and one error file per job; input files have no job (NULLs never clash).
        Index("ix_files_job_kind", "job_id", "kind", unique=True),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    purpose: Mapped[str] = mapped_column(String(32), index=True)
    kind: Mapped[str] = mapped_column(String(16))
    filename: Mapped[str] = mapped_column(Text)
    # None until measured: an output file's size is known once its content has been streamed once.
    bytes: Mapped[int | None] = mapped_column(BigInteger, default=None)
    lines: Mapped[int | None] = mapped_column(Integer, default=None)
    created_at: Mapped[float] = mapped_column(Float)
    expires_at: Mapped[float | None] = mapped_column(Float, default=None)
    job_id: Mapped[str | None] = mapped_column(String(64), default=None)
    # Input files: what a quick pass found, {"models": {name: first line}, "urls": {url: first line}}.
    scan: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    # The API key that created it (api/tenants.py: a hash, never the key); NULL: visible to every key.
    owner: Mapped[str | None] = mapped_column(String(64), default=None, index=True)


@dataclass(frozen=True)
class FileInfo:
    id: str
    purpose: str
    kind: str
    filename: str
    bytes: int | None
    lines: int | None
    created_at: float
    expires_at: float | None
    job_id: str | None
    scan: dict[str, Any] | None
    owner: str | None = None


_COLUMNS = [c.name for c in FileRow.__table__.columns]


class Files:
    """Reads and writes of the files table, through a Store's engine."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.url = store.url  # named in error messages by @retrying
        self.engine = store.engine

    @retrying
    def add(self, **fields: Any) -> FileInfo:
        """Insert a file row; `created_at` defaults to now."""
        fields.setdefault("created_at", time.time())
        with self.engine.begin() as conn:
            conn.execute(insert(FileRow).values(**fields))
        return self.get(fields["id"])  # type: ignore[return-value]

    @retrying
    def add_job_file(self, **fields: Any) -> FileInfo:
        """Insert the output or error file of a job, once: a concurrent second insert returns the first row."""
        fields.setdefault("created_at", time.time())
        try:
            with self.engine.begin() as conn:
                conn.execute(insert(FileRow).values(**fields))
        except IntegrityError:
            pass
        found = self.of_job(fields["job_id"], fields["kind"])
        assert found is not None
        return found

    @retrying
    def get(self, file_id: str) -> FileInfo | None:
        with self.engine.connect() as conn:
            row = conn.execute(select(FileRow.__table__).where(FileRow.id == file_id)).mappings().first()
        return FileInfo(**row) if row else None

    @retrying
    def of_job(self, job_id: str, kind: str) -> FileInfo | None:
        with self.engine.connect() as conn:
            row = (
                conn.execute(select(FileRow.__table__).where(FileRow.job_id == job_id, FileRow.kind == kind))
                .mappings()
                .first()
            )
        return FileInfo(**row) if row else None

    @retrying
    def page(
        self, *, after: str | None, limit: int, descending: bool, purpose: str | None, owner: str | None = None
    ) -> list[FileInfo]:
        """Up to `limit` files in id order (ids sort by creation time), starting past `after`; with `owner`,
        only that owner's files and those without one."""
        stmt = select(FileRow.__table__)
        if owner is not None:
            stmt = stmt.where(or_(FileRow.owner == owner, FileRow.owner.is_(None)))
        if purpose:
            stmt = stmt.where(FileRow.purpose == purpose)
        if after:
            stmt = stmt.where(FileRow.id < after if descending else FileRow.id > after)
        stmt = stmt.order_by(FileRow.id.desc() if descending else FileRow.id.asc()).limit(limit)
        with self.engine.connect() as conn:
            return [FileInfo(**r) for r in conn.execute(stmt).mappings()]

    @retrying
    def set_bytes(self, file_id: str, size: int) -> None:
        with self.engine.begin() as conn:
            conn.execute(update(FileRow).where(FileRow.id == file_id).values(bytes=size))

    @retrying
    def delete(self, file_id: str) -> bool:
        with self.engine.begin() as conn:
            return conn.execute(delete(FileRow).where(FileRow.id == file_id)).rowcount > 0

    @retrying
    def expired(self, now: float, limit: int = 100) -> list[FileInfo]:
        """Files whose expires_at has passed."""
        stmt = select(FileRow.__table__).where(FileRow.expires_at.is_not(None), FileRow.expires_at <= now)
        with self.engine.connect() as conn:
            return [FileInfo(**r) for r in conn.execute(stmt.limit(limit)).mappings()]


__all__ = ["ERRORS", "INPUT", "OUTPUT", "FileInfo", "FileRow", "Files"]
