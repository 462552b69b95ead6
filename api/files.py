"""Files: upload (streamed to the server's folder), list, retrieve, content, delete. Called by the routes and
by tests alike. Input files live on disk as `<files dir>/<id>.jsonl`; output and error files are streamed from
the store's request rows, in input order (jobs/output.py)."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from omlx_jobs.api.errors import BadRequest, NotFound, clip
from omlx_jobs.api.ids import FILE_PREFIX, is_file_id, new_id
from omlx_jobs.api.models import scan_file
from omlx_jobs.api.state import AppState
from omlx_jobs.api.tenants import EVERYONE, Tenant
from omlx_jobs.api.uploads import Upload
from omlx_jobs.jobs.output import OUTPUT_COLUMNS, output_lines
from omlx_jobs.store import RequestStatus
from omlx_jobs.store.files import ERRORS, INPUT, OUTPUT, FileInfo

BATCH = "batch"
BATCH_OUTPUT = "batch_output"
MIN_TTL, MAX_TTL = 3600, 30 * 24 * 3600
CHUNK_BYTES = 256 * 1024
"""Output content goes out in chunks of about this size (many lines each: one thread hop per chunk)."""
FILES_PAGE_MAX = 10_000
ERROR_STATUSES = (RequestStatus.FAILED, RequestStatus.CANCELLED)
PURPOSE = re.compile(r"[a-z_-]{1,32}")


def path_of(state: AppState, file_id: str) -> Path:
    """Where an input file's bytes live: only ever a checked id under the server's own folder."""
    if not is_file_id(file_id):
        raise NotFound(f"no file {clip(file_id)!r}", param="file_id")
    return state.config.files_dir / f"{file_id}.jsonl"


def file_object(f: FileInfo) -> dict[str, Any]:
    return {
        "id": f.id,
        "object": "file",
        "bytes": f.bytes if f.bytes is not None else 0,
        "created_at": int(f.created_at),
        "expires_at": int(f.expires_at) if f.expires_at is not None else None,
        "filename": f.filename,
        "purpose": f.purpose,
        "status": "processed",
        "status_details": None,
    }


def ttl_seconds(anchor: str | None, seconds: str | int | None, where: str) -> int | None:
    """An `expires_after` policy: anchor created_at, 3600 to 2592000 seconds. None when not given."""
    if anchor is None and seconds is None:
        return None
    if anchor != "created_at":
        raise BadRequest(f"{where}[anchor] must be 'created_at', got {clip(anchor)!r}", param=f"{where}[anchor]")
    try:
        value = int(seconds)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise BadRequest(
            f"{where}[seconds] must be an integer, got {clip(seconds)!r}", param=f"{where}[seconds]"
        ) from None
    if not MIN_TTL <= value <= MAX_TTL:
        raise BadRequest(
            f"{where}[seconds] must be between {MIN_TTL} (1 hour) and {MAX_TTL} (30 days), got {value}",
            param=f"{where}[seconds]",
        )
    return value


def store_upload(state: AppState, upload: Upload, tenant: Tenant = EVERYONE) -> dict[str, Any]:
    """Check a received upload's fields, scan its lines, move it into place and record it as `tenant`'s.
    Runs in a thread."""
    try:
        purpose = upload.fields.get("purpose")
        if purpose is None:
            raise BadRequest("the form field 'purpose' is missing; use purpose=batch", param="purpose")
        if purpose != BATCH:
            raise BadRequest(
                f"purpose {clip(purpose)!r} is not supported here; this server takes batch input files: purpose=batch",
                param="purpose",
                code="unsupported_purpose",
            )
        if upload.path is None:
            raise BadRequest("the form field 'file' is missing: send the JSONL file as 'file'", param="file")
        if upload.bytes == 0:
            raise BadRequest("the file is empty; a batch file holds one request per line", param="file")
        ttl = ttl_seconds(
            upload.fields.get("expires_after[anchor]"), upload.fields.get("expires_after[seconds]"), "expires_after"
        )
        scan = scan_file(upload.path)
        file_id = new_id(FILE_PREFIX)
        now = state.now()
        upload.path.rename(path_of(state, file_id))
        upload.path = None
    finally:
        upload.discard()
    info = state.files.add(
        id=file_id,
        purpose=BATCH,
        kind=INPUT,
        filename=upload.filename or "upload.jsonl",
        bytes=upload.bytes,
        lines=scan.lines,
        created_at=now,
        expires_at=now + (ttl if ttl is not None else state.config.default_file_ttl),
        scan=scan.to_dict(),
        owner=tenant.owner,
    )
    return file_object(info)


def get_file(state: AppState, file_id: str, tenant: Tenant = EVERYONE) -> FileInfo:
    """The file, if it exists for `tenant`: another key's file is a 404, as if it were absent."""
    info = state.files.get(file_id) if is_file_id(file_id) else None
    if info is None or not tenant.sees(info.owner):
        raise NotFound(f"no file {clip(file_id)!r}: it never existed, or it was deleted or expired", param="file_id")
    return info


def retrieve(state: AppState, file_id: str, tenant: Tenant = EVERYONE) -> dict[str, Any]:
    info = get_file(state, file_id, tenant)
    if info.bytes is None:  # an output file not downloaded yet: measure it once
        size = sum(len(chunk) for chunk in job_file_chunks(state, info))
        state.files.set_bytes(info.id, size)
        info = state.files.get(info.id) or info
    return file_object(info)


def list_files(
    state: AppState,
    *,
    after: str | None,
    limit: int,
    order: str,
    purpose: str | None,
    tenant: Tenant = EVERYONE,
) -> dict[str, Any]:
    """A page of `tenant`'s files. `after` must be a file id (it need not exist any more)."""
    if order not in ("asc", "desc"):
        raise BadRequest(f"order must be 'asc' or 'desc', got {clip(order)!r}", param="order")
    if not 1 <= limit <= FILES_PAGE_MAX:
        raise BadRequest(f"limit must be between 1 and {FILES_PAGE_MAX}, got {limit}", param="limit")
    if after is not None and not is_file_id(after):
        raise BadRequest(f"after must be a file id (file-...), got {clip(after)!r}", param="after")
    if purpose is not None and not PURPOSE.fullmatch(purpose):
        raise BadRequest(f"purpose must be a purpose name like batch, got {clip(purpose)!r}", param="purpose")
    rows = state.files.page(
        after=after, limit=limit + 1, descending=order == "desc", purpose=purpose, owner=tenant.scope
    )
    data = [file_object(f) for f in rows[:limit]]
    return page_object(data, has_more=len(rows) > limit)


def page_object(data: list[dict[str, Any]], *, has_more: bool) -> dict[str, Any]:
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }


def delete_file(state: AppState, file_id: str, tenant: Tenant = EVERYONE) -> dict[str, Any]:
    info = get_file(state, file_id, tenant)
    state.files.delete(info.id)
    if info.kind == INPUT:
        with contextlib.suppress(FileNotFoundError):
            path_of(state, info.id).unlink()
    return {"id": info.id, "object": "file", "deleted": True}


def job_file_chunks(state: AppState, info: FileInfo) -> Iterator[bytes]:
    """An output or error file's JSONL, generated from the store in input order, in chunks of ~CHUNK_BYTES."""
    assert info.job_id is not None and info.kind in (OUTPUT, ERRORS)
    job = state.store.get_job(info.job_id)
    statuses = ERROR_STATUSES if info.kind == ERRORS else (RequestStatus.COMPLETED,)
    rows = state.reports.iter_with_status(info.job_id, statuses, OUTPUT_COLUMNS)
    buf: list[str] = []
    size = 0
    for line, _ in output_lines(rows, info.job_id, job.model):
        buf.append(line)
        size += len(line)
        if size >= CHUNK_BYTES:
            yield ("\n".join(buf) + "\n").encode()
            buf, size = [], 0
    if buf:
        yield ("\n".join(buf) + "\n").encode()


def content_chunks(state: AppState, info: FileInfo) -> Iterator[bytes]:
    """An output or error file's content; its size is recorded once it has been streamed whole."""
    total = 0
    for chunk in job_file_chunks(state, info):
        total += len(chunk)
        yield chunk
    if info.bytes is None:
        state.files.set_bytes(info.id, total)


def remove_expired(state: AppState, now: float) -> int:
    """Delete files past their expires_at (rows, and the bytes of input files). Returns how many."""
    n = 0
    for info in state.files.expired(now):
        state.files.delete(info.id)
        if info.kind == INPUT:
            with contextlib.suppress(FileNotFoundError):
                path_of(state, info.id).unlink()
        n += 1
    return n


__all__ = [
    "BATCH",
    "BATCH_OUTPUT",
    "content_chunks",
    "delete_file",
    "file_object",
    "get_file",
    "list_files",
    "path_of",
    "remove_expired",
    "retrieve",
    "store_upload",
    "ttl_seconds",
]
