"""Batches: create (validated like `submit`, queued on the same queues), retrieve, list, cancel, and the
completion window. Functions the routes and the tests call alike."""

from __future__ import annotations

import logging
from typing import Any

from omlx_jobs.api import files as files_api
from omlx_jobs.api.config import COMPLETION_WINDOWS
from omlx_jobs.api.errors import BadRequest, NotFound, Unavailable, clip
from omlx_jobs.api.ids import BATCH_PREFIX, is_job_id, new_id
from omlx_jobs.api.models import resolve_model
from omlx_jobs.api.state import AppState
from omlx_jobs.api.tenants import EVERYONE, Tenant
from omlx_jobs.errors import ErrorCode
from omlx_jobs.jobs import actions, lifecycle
from omlx_jobs.jobs.formats import ENDPOINTS
from omlx_jobs.jobs.queue import RedisUnavailable, cancel_queued
from omlx_jobs.jobs.workers import served_models
from omlx_jobs.store.batches import BatchInfo
from omlx_jobs.store.db import JobCounts, JobInfo
from omlx_jobs.store.errors import JobNotFound
from omlx_jobs.store.files import ERRORS, INPUT, OUTPUT

log = logging.getLogger(__name__)

BATCHES_PAGE_MAX = 100
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512
EXPIRABLE = (lifecycle.VALIDATING, lifecycle.IN_PROGRESS)
ENDED = sorted(lifecycle.TERMINAL)


# ---- the Batch object ------------------------------------------------------------------------------


def _ts(value: float | None) -> int | None:
    return int(value) if value is not None else None


def batch_object(batch: BatchInfo, job: JobInfo, counts: JobCounts) -> dict[str, Any]:
    """OpenAI's Batch object; the job row gives status, counts and timestamps, the batch row the rest."""
    errors = None
    if job.errors and job.status == lifecycle.FAILED:
        errors = {
            "object": "list",
            "data": [
                {
                    "code": e.get("code"),
                    "line": e.get("line") or None,
                    "message": e.get("message"),
                    "param": e.get("field"),
                }
                for e in job.errors
            ],
        }
    return {
        "id": job.id,
        "object": "batch",
        "endpoint": batch.endpoint,
        "errors": errors,
        "input_file_id": batch.input_file_id,
        "completion_window": batch.completion_window,
        "status": job.status,
        "output_file_id": batch.output_file_id,
        "error_file_id": batch.error_file_id,
        "created_at": int(batch.created_at),
        "in_progress_at": _ts(job.in_progress_at),
        "expires_at": int(batch.expires_at),
        "finalizing_at": _ts(job.finalizing_at),
        "completed_at": _ts(job.completed_at),
        "failed_at": _ts(job.failed_at),
        "expired_at": _ts(batch.expired_at),
        "cancelling_at": _ts(job.cancelling_at),
        "cancelled_at": _ts(job.cancelled_at),
        "request_counts": {"total": counts.total, "completed": counts.completed, "failed": counts.failed},
        "metadata": batch.meta,
        "model": batch.model_name,
        "usage": {
            "input_tokens": counts.prompt_tokens,
            "input_tokens_details": {"cached_tokens": counts.cached_tokens},
            "output_tokens": counts.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": counts.prompt_tokens + counts.completion_tokens,
        },
    }


def _load(state: AppState, batch_id: str, tenant: Tenant) -> BatchInfo:
    """The batch, if it exists for `tenant`: another key's batch is a 404, as if it were absent."""
    batch = state.batches.get(batch_id) if is_job_id(batch_id) else None
    if batch is None or not tenant.sees(batch.owner):
        raise NotFound(f"no batch {clip(batch_id)!r}: list batches with GET /v1/batches", param="batch_id")
    return batch


def retrieve(state: AppState, batch_id: str, tenant: Tenant = EVERYONE) -> dict[str, Any]:
    """The Batch object, after expiring it if its window has passed and setting its files if it has ended."""
    batch = _load(state, batch_id, tenant)
    if batch.finalized_at is None:
        if batch.expires_at <= state.now():
            expire(state, batch.job_id)
        settle(state, batch.job_id)
        batch = finalize(state, batch.job_id) or batch
    return batch_object(batch, state.store.get_job(batch.job_id), state.store.counts(batch.job_id))


def settle(state: AppState, job_id: str) -> None:
    """Finish a job whose requests are all final but whose status says otherwise (its worker died between the
    last commit and finalizing it): workers finalize, and this catches the one they missed."""
    job = state.store.get_job(job_id)
    if job.status in (lifecycle.IN_PROGRESS, lifecycle.CANCELLING, lifecycle.FINALIZING):
        lifecycle.finalize_if_done(state.store, job_id)


def list_batches(state: AppState, *, after: str | None, limit: int, tenant: Tenant = EVERYONE) -> dict[str, Any]:
    """A page of `tenant`'s batches, newest first. `after` must be one of its batches (else a 400, not page one)."""
    if not 1 <= limit <= BATCHES_PAGE_MAX:
        raise BadRequest(f"limit must be between 1 and {BATCHES_PAGE_MAX}, got {limit}", param="limit")
    cursor = state.batches.get(after) if after is not None and is_job_id(after) else None
    if after is not None and (cursor is None or not tenant.sees(cursor.owner)):
        raise BadRequest(
            f"after={clip(after)!r} is no batch here: pass the last id of the previous page", param="after"
        )
    rows = state.batches.page(after=after, limit=limit + 1, owner=tenant.scope)
    data = [retrieve(state, b.job_id, tenant) for b in rows[:limit]]
    return files_api.page_object(data, has_more=len(rows) > limit)


# ---- create ---------------------------------------------------------------------------------------


def _metadata(value: Any) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or len(value) > MAX_METADATA_PAIRS:
        raise BadRequest(f"metadata must be an object of at most {MAX_METADATA_PAIRS} pairs", param="metadata")
    for k, v in value.items():
        if not isinstance(v, str) or len(k) > MAX_METADATA_KEY or len(v) > MAX_METADATA_VALUE:
            raise BadRequest(
                f"metadata[{clip(k, 64)!r}]: keys are strings of at most {MAX_METADATA_KEY} characters and "
                f"values strings of at most {MAX_METADATA_VALUE}",
                param="metadata",
            )
    return dict(value)


def _required_str(body: dict[str, Any], name: str) -> str:
    value = body.get(name)
    if value is None:
        raise BadRequest(f"{name} is required", param=name, code="missing_required_parameter")
    if not isinstance(value, str):
        raise BadRequest(f"{name} must be a string", param=name)
    return value


def create(state: AppState, body: dict[str, Any], tenant: Tenant = EVERYONE) -> dict[str, Any]:
    """Validate the request and the file's lines, create the job and queue its shards. Runs in a thread.

    A file with bad lines gives a batch that is `failed` with errors.data[].line, as OpenAI's does; a model
    nothing serves, several models in one file, or a line whose url is not the endpoint is a 400 right here.
    """
    file_id, endpoint, window, meta, out_ttl = _checked_params(body)
    scan = _checked_file(state, file_id, endpoint, tenant)
    try:
        redis = state.redis
        redis.ping()
        live = served_models(redis)
    except Exception as exc:
        raise Unavailable(f"Redis is unreachable ({exc}); nothing was created. Try again once Redis is up") from exc
    name, served = resolve_model(scan.get("models") or {}, state.config.models, live, scan.get("model_count", 0))
    served = live.get(served, served)  # a worker's short name: the model it serves

    now = state.now()
    job_id = new_id(BATCH_PREFIX)
    path = files_api.path_of(state, file_id)
    try:
        actions.submit(
            state.store, redis, path, served, job_id=job_id, shard_size=state.config.shard_size, model_name=name
        )
    except FileNotFoundError:
        raise NotFound(f"file {file_id} was deleted while the batch was created", param="input_file_id") from None
    except RedisUnavailable as exc:
        _fail_job(state, job_id, f"Redis failed while the batch was queued ({exc}); create the batch again")
        raise Unavailable(str(exc)) from exc
    finally:
        try:
            state.store.get_job(job_id)
            job_exists = True
        except JobNotFound:
            job_exists = False
        if job_exists:
            state.batches.add(
                job_id=job_id,
                input_file_id=file_id,
                endpoint=endpoint,
                completion_window=window,
                model_name=name,
                meta=meta,
                created_at=now,
                expires_at=now + COMPLETION_WINDOWS[window],
                output_expires_after=out_ttl,
                owner=tenant.owner,
            )
    return retrieve(state, job_id, tenant)


def _checked_params(body: dict[str, Any]) -> tuple[str, str, str, dict[str, str] | None, int | None]:
    """The create body's input_file_id, endpoint, completion_window, metadata and output TTL, or a 400."""
    unknown = sorted(set(body) - {"input_file_id", "endpoint", "completion_window", "metadata", "output_expires_after"})
    if unknown:
        name = clip(unknown[0], 64)
        raise BadRequest(f"unknown parameter {name!r}", param=name, code="unknown_parameter")
    file_id = _required_str(body, "input_file_id")
    endpoint = _required_str(body, "endpoint")
    window = _required_str(body, "completion_window")
    if endpoint not in ENDPOINTS:
        raise BadRequest(
            f"endpoint {clip(endpoint)!r} is not supported; use one of {', '.join(ENDPOINTS)}", param="endpoint"
        )
    if window not in COMPLETION_WINDOWS:
        raise BadRequest(
            f"completion_window must be one of {', '.join(COMPLETION_WINDOWS)}, got {clip(window)!r}",
            param="completion_window",
        )
    meta = _metadata(body.get("metadata"))
    out_ttl = None
    if body.get("output_expires_after") is not None:
        oea = body["output_expires_after"]
        if not isinstance(oea, dict):
            raise BadRequest(
                "output_expires_after must be an object with anchor and seconds", param="output_expires_after"
            )
        out_ttl = files_api.ttl_seconds(oea.get("anchor"), oea.get("seconds"), "output_expires_after")
    return file_id, endpoint, window, meta, out_ttl


def _checked_file(state: AppState, file_id: str, endpoint: str, tenant: Tenant) -> dict[str, Any]:
    """The input file's upload scan (its models and urls), after checking that it is a batch file whose every line's
    url is the batch's endpoint."""
    info = files_api.get_file(state, file_id, tenant)
    if info.kind != INPUT or info.purpose != files_api.BATCH:
        raise BadRequest(
            f"file {file_id} has purpose {info.purpose!r}; a batch needs a purpose=batch file", param="input_file_id"
        )
    scan = info.scan or {}
    for url, line in (scan.get("urls") or {}).items():
        if url != endpoint:
            raise BadRequest(
                f"line {line} of {file_id} has url {clip(url)!r} but the batch's endpoint is {endpoint!r}; every "
                "line's url must be the batch's endpoint",
                param="endpoint",
                code=ErrorCode.ENDPOINT_MISMATCH,
            )
    return scan


def _fail_job(state: AppState, job_id: str, message: str) -> None:
    try:
        state.store.update_job(
            job_id, errors=[{"line": 0, "field": None, "code": ErrorCode.SERVER_ERROR, "message": message}]
        )
        state.store.transition(job_id, lifecycle.FAILED, only_from=[lifecycle.VALIDATING, lifecycle.IN_PROGRESS])
    except Exception:
        log.exception("could not mark job %s failed", job_id)


# ---- cancel, expire, finalize -------------------------------------------------------------------------


def cancel(state: AppState, batch_id: str, tenant: Tenant = EVERYONE) -> dict[str, Any]:
    """Cancel: queued shards dropped, running ones stop, finished results kept. A 400 once the batch has ended
    (not a 409, which OpenAI's client retries)."""
    batch = _load(state, batch_id, tenant)
    job = state.store.get_job(batch.job_id)
    if job.status in lifecycle.TERMINAL:
        raise BadRequest(
            f"batch {batch_id} is {job.status}; only a validating or in_progress batch can be cancelled",
            param="batch_id",
            code="batch_not_cancellable",
        )
    try:
        redis = state.redis
        redis.ping()
    except Exception:
        redis = None  # cancel in the store; running shards see it within a second
    actions.cancel(state.store, redis, batch.job_id)
    return retrieve(state, batch_id, tenant)


def expire(state: AppState, job_id: str) -> bool:
    """Expire an unfinished batch past its window: pending requests end cancelled (batch_expired), finished
    results stay, the job becomes `expired`. Running shards stop within a second (they watch the status)."""
    job = state.store.get_job(job_id)
    if job.status not in EXPIRABLE:
        return False
    now = state.now()
    # Requests first: once none is pending, no worker commits anything more, and only then the status.
    n = state.batches.expire_pending(job_id, now)
    if n == 0:
        return False  # everything had finished: the job completes as usual
    state.store.transition(job_id, lifecycle.EXPIRED, only_from=[*EXPIRABLE, lifecycle.FINALIZING, lifecycle.COMPLETED])
    state.batches.mark_expired(job_id, now)
    if job.queue:
        try:
            cancel_queued(state.redis, job.queue, job_id)
        except Exception as exc:  # the shards left run as no-ops
            log.warning("could not drop the queued shards of expired batch %s: %s", job_id, exc)
    log.info("batch %s expired with %s request(s) unfinished", job_id, n)
    return True


def finalize(state: AppState, job_id: str) -> BatchInfo | None:
    """Once the job has ended, create its output and error file objects and set their ids on the batch."""
    job = state.store.get_job(job_id)
    if job.status not in lifecycle.TERMINAL:
        return None
    if job.status == lifecycle.EXPIRED:
        state.batches.expire_pending(job_id, state.now())  # a row a stopping worker marked cancelled meanwhile
    batch = state.batches.get(job_id)
    assert batch is not None
    counts = state.store.counts(job_id)
    now = state.now()
    ttl = batch.output_expires_after
    ids: dict[str, str | None] = {OUTPUT: None, ERRORS: None}
    for kind, n in ((OUTPUT, counts.completed), (ERRORS, counts.failed + counts.cancelled)):
        if n:
            f = state.files.add_job_file(
                id=new_id("file-"),
                purpose=files_api.BATCH_OUTPUT,
                kind=kind,
                filename=f"{job_id}_{kind}.jsonl",
                lines=n,
                job_id=job_id,
                created_at=now,
                expires_at=now + ttl if ttl else None,
                owner=batch.owner,  # the batch's tenant owns its output and error files
            )
            ids[kind] = f.id
    state.batches.finalize(job_id, ids[OUTPUT], ids[ERRORS], now)
    return state.batches.get(job_id)


def sweep(state: AppState) -> dict[str, int]:
    """One round of the server's housekeeping: expire batches past their window, set the files of batches
    that ended, delete expired files."""
    now = state.now()
    expired = sum(expire(state, job_id) for job_id in state.batches.due(now, list(EXPIRABLE)))
    for job_id in state.batches.unfinalized([lifecycle.IN_PROGRESS, lifecycle.CANCELLING, lifecycle.FINALIZING]):
        settle(state, job_id)
    finalized = 0
    for job_id in state.batches.unfinalized(ENDED):
        finalize(state, job_id)
        finalized += 1
    removed = files_api.remove_expired(state, now)
    return {"expired": expired, "finalized": finalized, "files_removed": removed}
