"""A job's requests a page at a time, for the web page's requests table: filtered by status or by outcome (a
finish reason or an error code), or searched by custom_id prefix; each page one index range, whatever the
job's size (keyset paging: a page starts past the last row of the one before, never at an OFFSET).

Texts come cut to a preview in SQL (`substr`), with their full length, so a page of large prompts or answers
moves no more than its previews; `request_row` reads one row whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, Text, cast, func, or_, select

from omlx_jobs.store.errors import retrying
from omlx_jobs.store.models import Request, outcome_expr
from omlx_jobs.store.textcodec import SafeText

PREVIEW_CHARS = 4000
"""Characters of a body or an output read for a page's previews."""
_TOP = "\U0010ffff"  # sorts after every character: a prefix range's upper end


@dataclass(frozen=True)
class RequestFilter:
    status: str | None = None
    outcome: str | None = None
    custom_id_prefix: str | None = None


@dataclass(frozen=True)
class Cursor:
    """Where a page starts (after) or ends (before): the idx of a row, and its custom_id when searching."""

    idx: int
    custom_id: str | None = None

    def encode(self) -> str:
        return str(self.idx) if self.custom_id is None else f"{self.idx}:{self.custom_id}"

    @classmethod
    def decode(cls, text: str) -> Cursor:
        """A cursor from `encode`; ValueError for anything else."""
        idx, sep, custom_id = text.partition(":")
        if not idx.isdigit():
            raise ValueError(f"not a page cursor: {text!r}")
        return cls(int(idx), custom_id if sep else None)


@dataclass(frozen=True)
class RequestPage:
    rows: list[Any]
    """Named rows: idx, line, custom_id, status, finish_reason, error_code, error_message, token counts, the
    body and output previews (body_text, output_text) and their full lengths (body_chars, output_chars)."""
    has_before: bool
    has_after: bool


_COLUMNS = (
    Request.idx,
    Request.line,
    Request.custom_id,
    Request.endpoint,
    Request.status,
    Request.finish_reason,
    Request.error_code,
    Request.error_message,
    Request.prompt_tokens,
    Request.cached_tokens,
    Request.completion_tokens,
    Request.attempts,
    func.substr(cast(Request.body, Text), 1, PREVIEW_CHARS).label("body_text"),
    func.length(cast(Request.body, Text)).label("body_chars"),
    func.substr(Request.output_text, 1, PREVIEW_CHARS, type_=SafeText).label("output_text"),
    func.length(Request.output_text).label("output_chars"),
)


class RequestPages:
    """Reads of one job's requests for the page, through a Store's engine."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.url = store.url
        self.engine: Engine = store.engine

    @retrying
    def page(
        self,
        job_id: str,
        where: RequestFilter,
        *,
        after: Cursor | None = None,
        before: Cursor | None = None,
        limit: int = 25,
    ) -> RequestPage:
        """Up to `limit` rows matching `where`, in input order (by custom_id then input order when searching),
        after `after` or before `before` (neither: the first page)."""
        search = where.custom_id_prefix or None
        stmt = select(*_COLUMNS).where(Request.job_id == job_id)
        if where.status:
            stmt = stmt.where(Request.status == where.status)
        if where.outcome:
            stmt = stmt.where(outcome_expr == where.outcome)
        if search:
            pattern = search.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
            stmt = stmt.where(
                Request.custom_id >= search, Request.custom_id < search + _TOP, Request.custom_id.like(pattern, "\\")
            )
        order = (Request.custom_id, Request.idx) if search else (Request.idx,)
        backwards = before is not None and after is None
        cursor = before if backwards else after
        if cursor is not None:
            stmt = stmt.where(_past(cursor, backwards, search is not None))
        stmt = stmt.order_by(*(c.desc() for c in order) if backwards else order).limit(limit + 1)
        with self.engine.connect() as conn:
            rows = conn.execute(stmt).all()
        more = len(rows) > limit
        rows = rows[:limit]
        if backwards:
            rows.reverse()
            return RequestPage(rows, has_before=more, has_after=True)
        return RequestPage(rows, has_before=after is not None, has_after=more)

    @retrying
    def request_row(self, job_id: str, idx: int) -> Any | None:
        """One request whole (every column), or None."""
        stmt = select(Request.__table__).where(Request.job_id == job_id, Request.idx == idx)
        with self.engine.connect() as conn:
            return conn.execute(stmt).first()


def _past(cursor: Cursor, backwards: bool, search: bool) -> Any:
    """Rows after the cursor (before it, going backwards), in the page's order."""
    if not search or cursor.custom_id is None:
        return Request.idx < cursor.idx if backwards else Request.idx > cursor.idx
    if backwards:
        return or_(
            Request.custom_id < cursor.custom_id,
            (Request.custom_id == cursor.custom_id) & (Request.idx < cursor.idx),
        )
    return or_(
        Request.custom_id > cursor.custom_id, (Request.custom_id == cursor.custom_id) & (Request.idx > cursor.idx)
    )


__all__ = ["Cursor", "RequestFilter", "RequestPage", "RequestPages"]
