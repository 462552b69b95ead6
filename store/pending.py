"""The store's pending requests as a worker reads them: a shard's rows page by page, and refunded attempts.

A mixin of Store (store/db.py), which holds the engine.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sqlalchemy import Engine, and_, func, select, tuple_, update

from omlx_jobs.store.errors import retrying
from omlx_jobs.store.models import Request, RequestStatus
from omlx_jobs.store.shards import ShardCut, in_shard

PAGE_ROWS = 1024
"""Rows per page a worker reads and plans: its memory for pending rows is one page, whatever the shard's size (one
page holds a default shard: jobs/sharding.py)."""


@dataclass(frozen=True)
class PendingRequest:
    id: int
    idx: int
    line: int
    custom_id: str
    endpoint: str
    body: dict[str, Any]
    attempts: int
    sort_key: bytes = b""


_COLUMNS = (
    Request.id,
    Request.idx,
    Request.line,
    Request.custom_id,
    Request.endpoint,
    Request.body,
    Request.attempts,
    Request.sort_key,
)


class PendingStore:
    engine: Engine
    if TYPE_CHECKING:

        def shard_bounds(self, job_id: str, first_pos: int) -> ShardCut | None: ...  # ShardStore's

    def pending_requests(self, job_id: str, start: int = 0, end: int | None = None) -> list[PendingRequest]:
        """Requests of the shard starting at position `start` without a final result, in prefix order; with
        end=None, every pending request of the job (`omlx-jobs run`). A shard the job lacks has none."""
        return [r for page in self.pending_pages(job_id, start, end, page_rows=None) for r in page]

    @retrying
    def count_pending(self, job_id: str, start: int, end: int) -> int:
        """How many requests of the shard starting at position `start` have no final result (what a stopped shard
        hands back to the queue)."""
        bounds = self.shard_bounds(job_id, start)
        cond = [Request.job_id == job_id, Request.status == RequestStatus.PENDING]
        if bounds is None:
            return 0
        with self.engine.connect() as conn:
            stmt = select(func.count()).select_from(Request).where(*cond, in_shard(bounds))
            return int(conn.execute(stmt).scalar_one())

    def pending_pages(
        self, job_id: str, start: int = 0, end: int | None = None, *, page_rows: int | None = PAGE_ROWS
    ) -> Iterator[list[PendingRequest]]:
        """pending_requests, `page_rows` rows at a time (None: one page). Keyset pages: each continues after the
        (sort_key, idx) of the last row of the one before, one short read and one index range scan
        (ix_requests_job_status_key), so a shard of any size is read in constant memory."""
        cond = [Request.job_id == job_id, Request.status == RequestStatus.PENDING]
        if end is not None:
            bounds = self.shard_bounds(job_id, start)
            if bounds is None:
                return
            cond.append(in_shard(bounds))
        after: tuple[bytes, int] | None = None
        while True:
            page = self._pending_page(cond, after, page_rows)
            if page:
                yield page
            if page_rows is None or len(page) < page_rows:
                return
            after = (page[-1].sort_key, page[-1].idx)

    @retrying
    def _pending_page(
        self, cond: list[Any], after: tuple[bytes, int] | None, limit: int | None
    ) -> list[PendingRequest]:
        where = [*cond]
        if after is not None:
            where.append(tuple_(Request.sort_key, Request.idx) > tuple_(*after))
        stmt = select(*_COLUMNS).where(and_(*where)).order_by(Request.sort_key, Request.idx)
        with self.engine.connect() as conn:
            rows = conn.execute(stmt.limit(limit) if limit is not None else stmt)
            return [PendingRequest(*r[:-1], sort_key=r[-1] or b"") for r in rows]

    @retrying
    def refund_attempts(self, request_ids: list[int]) -> None:
        """Take back one counted attempt of each pending request (mark_started counted it): its run ended in an
        engine exception that worker/containment.py contains, so the attempt says nothing against it."""
        with self.engine.begin() as conn:
            for i in range(0, len(request_ids), 500):
                conn.execute(
                    update(Request)
                    .where(
                        Request.id.in_(request_ids[i : i + 500]),
                        Request.status == RequestStatus.PENDING,
                        Request.attempts > 0,
                    )
                    .values(attempts=Request.attempts - 1)
                )
