"""Store: sessions over the jobs/requests tables, SQLite by default, any SQLAlchemy URL otherwise.

Every write is its own short transaction, so a result is durable the moment `record_*` returns.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

from sqlalchemy import (
    Engine,
    and_,
    case,
    create_engine,
    delete,
    event,
    func,
    or_,
    select,
    update,
)
from sqlalchemy.engine import make_url
from sqlalchemy.exc import SQLAlchemyError

from omlx_jobs.errors import ErrorCode
from omlx_jobs.store import schema
from omlx_jobs.store import statements as st
from omlx_jobs.store.errors import (
    JobNotFound,
    StoreError,
    StoreMissing,
    StoreUnavailable,
    is_data_error,
    retrying,
    safe_url,
)
from omlx_jobs.store.jobs import JobCounts, JobInfo, JobStore
from omlx_jobs.store.models import FINAL_REQUEST_STATUSES, Request, RequestStatus, ShardRun
from omlx_jobs.store.pending import PendingRequest, PendingStore
from omlx_jobs.store.rows import CompletionRow
from omlx_jobs.store.shards import ShardStore, in_shard
from omlx_jobs.store.ticks import TickStore

P = ParamSpec("P")
T = TypeVar("T")

DB_FILENAME = "omlx-jobs.db"
_LOCK_RETRIES = 8


def data_dir() -> Path:
    """Where the default SQLite file lives: $OMLX_JOBS_HOME, else $XDG_DATA_HOME/omlx-jobs."""
    if os.environ.get("OMLX_JOBS_HOME"):
        return Path(os.environ["OMLX_JOBS_HOME"]).expanduser()
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "omlx-jobs"


def default_database_url(db_path: str | os.PathLike[str] | None = None) -> str:
    """Resolve the database: `db_path` (--db), then OMLX_JOBS_DATABASE_URL, OMLX_JOBS_DB, the data dir."""
    if db_path:
        return f"sqlite:///{Path(db_path).expanduser().resolve()}"
    if os.environ.get("OMLX_JOBS_DATABASE_URL"):
        return os.environ["OMLX_JOBS_DATABASE_URL"]
    if os.environ.get("OMLX_JOBS_DB"):
        return f"sqlite:///{Path(os.environ['OMLX_JOBS_DB']).expanduser().resolve()}"
    return f"sqlite:///{(data_dir() / DB_FILENAME).resolve()}"


def open_store(url: str | None = None, db_path: str | os.PathLike[str] | None = None, *, create: bool = True) -> Store:
    """Open the store at `url`, or the default location; with create=False a missing database is an error
    (StoreMissing) rather than a new empty file: read-only commands must not leave one behind."""
    return Store(url or default_database_url(db_path), create=create)


UNSTORABLE = ErrorCode.UNSTORABLE_RESULT
"""The error code of a result the database refused (its data, not the database, was the problem)."""


class Store(JobStore, ShardStore, PendingStore, TickStore):
    """All reads and writes: jobs (JobStore), requests (here; pending ones as workers read them: PendingStore),
    shards and shard runs (ShardStore), live token counts (TickStore)."""

    def __init__(self, url: str, *, create: bool = True) -> None:
        self.url = url
        parsed = make_url(url)
        self.is_sqlite = parsed.get_backend_name() == "sqlite"
        kwargs: dict[str, Any] = {"future": True}
        if self.is_sqlite:
            database = parsed.database
            if database and database != ":memory:" and not database.startswith("file:"):
                if not create and not Path(database).exists():
                    raise StoreMissing(
                        f"no database at {database}: nothing was submitted there yet. Point --db (or "
                        "OMLX_JOBS_DB / OMLX_JOBS_DATABASE_URL) at the database `submit` used"
                    )
                _create_private_file(Path(database))
            kwargs["connect_args"] = {"timeout": 30}
        else:
            kwargs["pool_pre_ping"] = True
        try:
            self.engine: Engine = create_engine(url, **kwargs)
        except (SQLAlchemyError, ImportError) as exc:
            raise StoreError(f"cannot open the database {safe_url(url)}: {exc}") from exc
        if self.is_sqlite:
            event.listen(self.engine, "connect", _sqlite_pragmas)
        self._upgrade(create)

    @retrying
    def _upgrade(self, create: bool) -> None:
        """Migrate to the current schema (store/schema.py); a read-only open of an empty database stops."""
        if not create:
            with self.engine.connect() as conn:
                if not schema.has_tables(conn):
                    raise StoreMissing(f"the database {safe_url(self.url)} holds no omlx-jobs tables yet")
        schema.upgrade(self.engine)

    def close(self) -> None:
        self.engine.dispose()

    @retrying
    def ping(self) -> None:
        """One round trip to the database: StoreUnavailable while its server is away."""
        with self.engine.connect() as conn:
            conn.exec_driver_sql("SELECT 1")

    # ---- requests: writing ---------------------------------------------------------------------

    @retrying
    def add_requests(self, rows: list[dict[str, Any]]) -> None:
        """Insert a chunk of request rows (dicts with st.REQUEST_INSERT_FIELDS) in one transaction.

        Bodies are serialized here, once; a missing body (an invalid input line) is stored as SQL NULL, not
        JSON null, so `reset_for_retry` can leave those lines out. SQLite gets a plain executemany and PostgreSQL
        (psycopg) a COPY; other databases a SQLAlchemy insert.
        """
        if not rows:
            return
        now = time.time()
        values = [st.request_values(r, now) for r in rows]
        with self.engine.begin() as conn:
            # The fast paths skip SQLAlchemy's per-row parameter processing, the bulk of a Core executemany.
            if self.is_sqlite:
                conn.exec_driver_sql(st.SQLITE_INSERT_REQUESTS, values)
            elif conn.dialect.driver == "psycopg":
                st.copy_requests(conn, values)
            else:
                conn.execute(st.INSERT_REQUESTS, [dict(zip(st.INSERT_PARAM_NAMES, v, strict=True)) for v in values])

    @retrying
    def delete_requests(self, job_id: str) -> None:
        with self.engine.begin() as conn:
            conn.execute(delete(Request).where(Request.job_id == job_id))

    @retrying
    def mark_started(self, request_ids: list[int]) -> None:
        """Count an attempt for each request about to run."""
        if not request_ids:
            return
        now = time.time()
        with self.engine.begin() as conn:
            for chunk in _chunks(request_ids, 500):
                conn.execute(
                    update(Request)
                    .where(Request.id.in_(chunk), Request.status == RequestStatus.PENDING)
                    .values(attempts=Request.attempts + 1, started_at=func.coalesce(Request.started_at, now))
                )

    def record_completion(self, request_id: int, **fields: Any) -> bool:
        """Store one finished request; `fields` are CompletionRow's (a wrong name raises TypeError)."""
        return self.record_completions([CompletionRow(id=request_id, **fields)]) == 1

    def record_completions(self, results: Sequence[CompletionRow], *, run_id: int | None = None) -> int:
        """Store finished requests in one transaction; returns how many were stored.

        Only a pending request takes a result, so there is never a second one. `run_id` (a shard run) is
        recorded with each result and counts them.

        A result whose data the database refuses (a value out of range, say) is not a store failure: the
        batch is stored row by row, and each refused request fails alone with `unstorable_result`.
        """
        try:
            return self._record_completions(results, run_id)
        except _RowRefused:
            pass
        stored = 0
        for r in results:
            try:
                stored += self._record_completions([r], run_id)
            except _RowRefused as refused:
                message = (
                    f"the database refused this result ({refused.reason}); nothing was stored for it. "
                    "Run `omlx-jobs retry JOB` to generate it again"
                )
                self.record_failure(r.id, UNSTORABLE, message, prompt_tokens=None, run_id=run_id)
        return stored

    @retrying
    def _record_completions(self, results: Sequence[CompletionRow], run_id: int | None) -> int:
        now = time.time()
        stored = 0
        try:
            with self.engine.begin() as conn:
                for row in results:
                    stored += conn.execute(st.COMPLETE, {**st.completion_params(row, now), "run_id": run_id}).rowcount
                if run_id is not None and stored:
                    conn.execute(
                        update(ShardRun).where(ShardRun.id == run_id).values(completed=ShardRun.completed + stored)
                    )
        except Exception as exc:
            if is_data_error(exc):
                raise _RowRefused(exc) from exc
            raise
        return stored

    @retrying
    def record_failure(
        self,
        request_id: int,
        code: str,
        message: str,
        *,
        prompt_tokens: int | None = None,
        run_id: int | None = None,
    ) -> bool:
        """Mark a pending request failed with a typed error code."""
        with self.engine.begin() as conn:
            res = conn.execute(
                update(Request)
                .where(Request.id == request_id, Request.status == RequestStatus.PENDING)
                .values(
                    status=RequestStatus.FAILED,
                    error_code=str(code),  # an ErrorCode's value, or a plain string
                    error_message=message,
                    prompt_tokens=prompt_tokens,
                    finished_at=time.time(),
                    run_id=run_id,
                )
            )
            if run_id is not None and res.rowcount:
                conn.execute(update(ShardRun).where(ShardRun.id == run_id).values(failed=ShardRun.failed + 1))
            return res.rowcount > 0

    @retrying
    def fail_pending(self, job_id: str, first_pos: int, code: str, message: str) -> int:
        """Fail every pending request of the shard at `first_pos` with one error; returns how many."""
        bounds = self.shard_bounds(job_id, first_pos)
        if bounds is None:
            return 0
        with self.engine.begin() as conn:
            return conn.execute(
                update(Request)
                .where(Request.job_id == job_id, Request.status == RequestStatus.PENDING, in_shard(bounds))
                .values(status=RequestStatus.FAILED, error_code=code, error_message=message, finished_at=time.time())
            ).rowcount

    @retrying
    def cancel_pending(self, job_id: str, request_ids: list[int] | None = None) -> int:
        """Mark pending requests of a job (or just `request_ids`) cancelled; returns how many."""
        now = time.time()
        with self.engine.begin() as conn:
            stmt = update(Request).where(Request.job_id == job_id, Request.status == RequestStatus.PENDING)
            if request_ids is None:
                return conn.execute(stmt.values(status=RequestStatus.CANCELLED, finished_at=now)).rowcount
            total = 0
            for chunk in _chunks(request_ids, 500):
                total += conn.execute(
                    stmt.where(Request.id.in_(chunk)).values(status=RequestStatus.CANCELLED, finished_at=now)
                ).rowcount
            return total

    @retrying
    def reset_for_retry(
        self, job_id: str, *, include_cancelled: bool = False, retry_codes: Iterable[str] | None = None
    ) -> int:
        """Put failed (and optionally cancelled) requests back to pending, except invalid input lines.

        With `retry_codes`, only failures with one of those error codes go back (the others are permanent).
        """
        failed = Request.status == RequestStatus.FAILED
        if retry_codes is not None:
            failed = and_(failed, Request.error_code.in_([str(c) for c in retry_codes]))
        which = or_(failed, Request.status == RequestStatus.CANCELLED) if include_cancelled else failed
        with self.engine.begin() as conn:
            return conn.execute(
                update(Request)
                .where(Request.job_id == job_id, which, Request.body.is_not(None))
                .values(
                    status=RequestStatus.PENDING,
                    error_code=None,
                    error_message=None,
                    finished_at=None,
                    # A request given up after too many attempts gets a fresh allowance; others keep theirs.
                    attempts=case((Request.error_code == ErrorCode.TOO_MANY_ATTEMPTS.value, 0), else_=Request.attempts),
                )
            ).rowcount

    # ---- requests: reading ---------------------------------------------------------------------

    @retrying
    def iter_requests(
        self, job_id: str, batch_size: int = 1000, *, columns: Sequence[str] | None = None
    ) -> Iterator[Any]:
        """Stream every request row of a job in input order, `batch_size` positions at a time, as named tuples.

        `columns` names the columns to read (default all); leaving out `body` spares decoding every prompt.
        Pages are idx ranges (idx runs 0..total-1), each a short transaction and an index range scan whatever
        the planner's statistics say (an ORDER BY ... LIMIT page right after a bulk insert got a full scan on
        PostgreSQL, so export time grew with the square of the job's size).
        """
        table = Request.__table__
        cols = [table.c[name] for name in columns] if columns is not None else list(table.c)
        row_type = st.row_type(tuple(c.name for c in cols))
        first, last = self._idx_bounds(job_id)
        if first is None or last is None:
            return
        for lo in range(first, last + 1, batch_size):
            yield from map(row_type._make, self._page(job_id, lo, lo + batch_size, cols))

    @retrying
    def _idx_bounds(self, job_id: str) -> tuple[int | None, int | None]:
        with self.engine.connect() as conn:
            row = conn.execute(select(func.min(Request.idx), func.max(Request.idx)).where(Request.job_id == job_id))
            first, last = row.one()
            return first, last

    @retrying
    def _page(self, job_id: str, lo: int, hi: int, cols: list[Any]) -> list[Any]:
        """Rows with lo <= idx < hi, in idx order."""
        with self.engine.connect() as conn:
            return conn.execute(
                select(*cols).where(Request.job_id == job_id, Request.idx >= lo, Request.idx < hi).order_by(Request.idx)
            ).all()

    @retrying
    def request_statuses(self, job_id: str) -> dict[str, str]:
        """custom_id -> status, for tests and small jobs."""
        with self.engine.connect() as conn:
            rows = conn.execute(select(Request.custom_id, Request.status).where(Request.job_id == job_id))
            return {r[0]: r[1] for r in rows}


class _RowRefused(Exception):
    """The database refused a row's data; record_completions then stores the batch row by row."""

    def __init__(self, exc: BaseException) -> None:
        text = str(getattr(exc, "orig", None) or exc)
        self.reason = (text.splitlines() or [type(exc).__name__])[0][:300]
        super().__init__(self.reason)


def _chunks(items: list[int], n: int) -> Iterator[list[int]]:
    for i in range(0, len(items), n):
        yield items[i : i + n]


def _create_private_file(path: Path) -> None:
    """Create the SQLite file (and its folder) readable by the owner only: it holds every prompt."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o600)
        os.close(fd)


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.execute("PRAGMA busy_timeout=30000")
    cur.close()


__all__ = [
    "FINAL_REQUEST_STATUSES",
    "JobCounts",
    "JobInfo",
    "JobNotFound",
    "PendingRequest",
    "Store",
    "StoreError",
    "StoreUnavailable",
]
