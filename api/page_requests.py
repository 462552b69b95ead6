"""A job's requests for the page: a table page at a time (filtered by status or outcome, searched by custom_id,
keyset-paged: store/request_pages.py), each row's input and output cut to a preview, and one request whole
(its input line and its output line, as `results` writes it)."""

from __future__ import annotations

import json
from typing import Any

from omlx_jobs.api.errors import BadRequest, NotFound
from omlx_jobs.api.page import get_job
from omlx_jobs.api.state import AppState
from omlx_jobs.api.tenants import EVERYONE, Tenant
from omlx_jobs.jobs.output import output_line
from omlx_jobs.store.models import RequestStatus
from omlx_jobs.store.request_pages import PREVIEW_CHARS, Cursor, RequestFilter, RequestPages

PREVIEW = 140
"""Characters of an input or output shown in the table; the row links to the whole request."""
PAGE_MAX = 200
STATUSES = (RequestStatus.PENDING, RequestStatus.COMPLETED, RequestStatus.FAILED, RequestStatus.CANCELLED)


def _cut(text: str, limit: int = PREVIEW) -> tuple[str, bool]:
    return (text, False) if len(text) <= limit else (text[:limit].rstrip() + "…", True)


def _text_of(content: Any) -> str:
    """A message's content as text: a string, or its text parts joined (an image part shows as [image])."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(
            p.get("text", "") if p.get("type") == "text" else f"[{p.get('type', 'part')}]"
            for p in content
            if isinstance(p, dict)
        )
    return ""


def input_preview(body_text: str | None, body_chars: int | None) -> tuple[str, bool]:
    """What a request asks, short: its last message (role: text) or its prompt; the body's start when the
    body is larger than the part read for previews."""
    if not body_text:
        return "", False
    try:
        body = json.loads(body_text) if (body_chars or 0) <= PREVIEW_CHARS else None
    except ValueError:
        body = None
    if not isinstance(body, dict):
        return _cut(body_text)[0], True
    messages = body.get("messages")
    if isinstance(messages, list) and messages and isinstance(messages[-1], dict):
        last = messages[-1]
        return _cut(f"{last.get('role', '?')}: {_text_of(last.get('content'))}")
    items = body.get("input")  # an embeddings request: how many items, and the first
    if isinstance(items, list) and items:
        first = items[0] if isinstance(items[0], str) else f"[{len(items[0])} token ids]"
        return _cut(f"{len(items)} input(s): {first}")
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        return f"[{len(prompt)} token ids]", False
    return _cut(str(prompt if prompt is not None else body_text))


def _output_preview(r: Any) -> tuple[str, bool]:
    if r.status == RequestStatus.COMPLETED and getattr(r, "finish_reason", None) == "embedded":
        return "embedded (vectors in the output line)", False
    if r.status == RequestStatus.COMPLETED:
        text, cut = _cut(r.output_text or "")
        return text, cut or (r.output_chars or 0) > len(r.output_text or "")
    if r.status == RequestStatus.FAILED or r.error_code:
        return _cut(f"{r.error_code}: {r.error_message or ''}")
    return ("cancelled" if r.status == RequestStatus.CANCELLED else ""), False


def _row(job_id: str, r: Any) -> dict[str, Any]:
    text_in, cut_in = input_preview(r.body_text, r.body_chars)
    text_out, cut_out = _output_preview(r)
    return {
        "idx": r.idx,
        "line": r.line,
        "custom_id": r.custom_id,
        "status": r.status,
        "outcome": r.error_code or r.finish_reason,
        "prompt_tokens": r.prompt_tokens,
        "cached_tokens": r.cached_tokens,
        "completion_tokens": r.completion_tokens,
        "attempts": r.attempts,
        "input": text_in,
        "input_cut": cut_in,
        "output": text_out,
        "output_cut": cut_out,
        "href": f"/api/jobs/{job_id}/requests/{r.idx}",
    }


def _decode(name: str, text: str | None) -> Cursor | None:
    try:
        return Cursor.decode(text) if text else None
    except ValueError:
        raise BadRequest(f"{name}={text!r} is not a cursor of this table: use the one it gave", param=name) from None


def requests_view(
    state: AppState,
    job_id: str,
    *,
    status: str | None = None,
    outcome: str | None = None,
    q: str | None = None,
    after: str | None = None,
    before: str | None = None,
    limit: int = 25,
    tenant: Tenant = EVERYONE,
) -> dict[str, Any]:
    """A page of the job's requests. `after`/`before`: the `last`/`first` cursor of the page shown."""
    get_job(state, job_id, tenant)
    if not 1 <= limit <= PAGE_MAX:
        raise BadRequest(f"limit must be between 1 and {PAGE_MAX}, got {limit}", param="limit")
    if status and status not in STATUSES:
        raise BadRequest(f"status must be one of {', '.join(STATUSES)}, got {status!r}", param="status")
    where = RequestFilter(status=status or None, outcome=outcome or None, custom_id_prefix=q or None)
    page = RequestPages(state.store).page(
        job_id, where, after=_decode("after", after), before=_decode("before", before), limit=limit
    )
    search = bool(where.custom_id_prefix)

    def cursor(r: Any) -> str:
        return Cursor(r.idx, r.custom_id if search else None).encode()

    return {
        "rows": [_row(job_id, r) for r in page.rows],
        "first": cursor(page.rows[0]) if page.rows and page.has_before else None,
        "last": cursor(page.rows[-1]) if page.rows and page.has_after else None,
        "filters": {"status": status, "outcome": outcome, "q": q},
    }


def request_view(state: AppState, job_id: str, idx: str, tenant: Tenant = EVERYONE) -> dict[str, Any]:
    """One request whole: its input line (custom_id, method, url, body) and its output line (null while it
    is pending), as `results` would write it."""
    job = get_job(state, job_id, tenant)
    if not idx.isdigit():
        raise NotFound(f"no request {idx!r} in {job_id}: requests are numbered by input position", param="idx")
    row = RequestPages(state.store).request_row(job_id, int(idx))
    if row is None:
        raise NotFound(f"no request {idx} in {job_id}: it holds requests 0 to {job.total - 1}", param="idx")
    models = state.store.run_models(job_id) if row.run_id is not None else {}
    result = None
    if row.status != RequestStatus.PENDING:
        result, _ = output_line(row, job_id, models.get(row.run_id, job.model))
    return {
        "idx": row.idx,
        "line": row.line,
        "status": row.status,
        "request": {"custom_id": row.custom_id, "method": "POST", "url": row.endpoint, "body": row.body},
        "result": result,
        "attempts": row.attempts,
        "started_at": row.started_at,
        "finished_at": row.finished_at,
    }
