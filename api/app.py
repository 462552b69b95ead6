"""The ASGI app: routes (thin: each calls a function in files, batches, page or metrics), the guard, errors
in OpenAI's shape, and the housekeeping loop (completion windows, output files, file expiry)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from importlib import resources
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from omlx_jobs.api import batches, files, metrics, page, page_requests, uploads
from omlx_jobs.api.auth import Guard
from omlx_jobs.api.bodies import json_body
from omlx_jobs.api.config import ServeConfig
from omlx_jobs.api.errors import ApiError, BadRequest, NotFound, Unavailable, clip, server_error
from omlx_jobs.api.state import AppState, state_of
from omlx_jobs.api.tenants import tenant_of
from omlx_jobs.jobs.queue import RedisUnavailable
from omlx_jobs.store import StoreError
from omlx_jobs.store.files import INPUT

log = logging.getLogger(__name__)

STATIC = resources.files("omlx_jobs.api") / "static"
SECURITY_HEADERS = {
    # Everything the page loads comes from this server; nothing inline, nothing from elsewhere.
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
}


def _int_param(request: Request, name: str, default: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise BadRequest(f"{name} must be an integer, got {clip(raw)!r}", param=name) from None


# ---- files --------------------------------------------------------------------------------------------


async def create_file(request: Request) -> Response:
    state = state_of(request)
    cfg = state.config
    upload = await uploads.receive(
        request, cfg.files_dir, max_bytes=cfg.max_upload_bytes, max_lines=cfg.max_upload_lines
    )
    return JSONResponse(await run_in_threadpool(files.store_upload, state, upload, tenant_of(request)))


def list_files(request: Request) -> Response:
    q = request.query_params
    return JSONResponse(
        files.list_files(
            state_of(request),
            after=q.get("after"),
            limit=_int_param(request, "limit", files.FILES_PAGE_MAX),
            order=q.get("order", "desc"),
            purpose=q.get("purpose"),
            tenant=tenant_of(request),
        )
    )


def retrieve_file(request: Request) -> Response:
    return JSONResponse(files.retrieve(state_of(request), request.path_params["file_id"], tenant_of(request)))


def delete_file(request: Request) -> Response:
    return JSONResponse(files.delete_file(state_of(request), request.path_params["file_id"], tenant_of(request)))


def file_content(request: Request) -> Response:
    state = state_of(request)
    info = files.get_file(state, request.path_params["file_id"], tenant_of(request))
    headers = {"Content-Disposition": f'attachment; filename="{info.id}.jsonl"'}
    if info.kind == INPUT:
        path = files.path_of(state, info.id)
        if not path.exists():
            raise NotFound(f"the bytes of {info.id} are gone from the server's folder", param="file_id")
        return FileResponse(path, media_type="application/octet-stream", headers=headers)
    return StreamingResponse(files.content_chunks(state, info), media_type="application/octet-stream", headers=headers)


# ---- batches ------------------------------------------------------------------------------------------


async def create_batch(request: Request) -> Response:
    body = await json_body(request)
    return JSONResponse(await run_in_threadpool(batches.create, state_of(request), body, tenant_of(request)))


def list_batches(request: Request) -> Response:
    return JSONResponse(
        batches.list_batches(
            state_of(request),
            after=request.query_params.get("after"),
            limit=_int_param(request, "limit", 20),
            tenant=tenant_of(request),
        )
    )


def retrieve_batch(request: Request) -> Response:
    return JSONResponse(batches.retrieve(state_of(request), request.path_params["batch_id"], tenant_of(request)))


def cancel_batch(request: Request) -> Response:
    return JSONResponse(batches.cancel(state_of(request), request.path_params["batch_id"], tenant_of(request)))


# ---- page, metrics, health ------------------------------------------------------------------------------


def index(request: Request) -> Response:
    html = (STATIC / "index.html").read_text(encoding="utf-8")
    refresh = str(int(state_of(request).config.page_refresh_seconds * 1000))
    return Response(html.replace("{{refresh_ms}}", refresh), media_type="text/html; charset=utf-8")


def api_jobs(request: Request) -> Response:
    q = request.query_params
    limit = _int_param(request, "limit", page.JOBS_PAGE)
    return JSONResponse(
        page.jobs_view(
            state_of(request),
            limit,
            status=q.get("status"),
            model=q.get("model"),
            q=q.get("q"),
            before=q.get("before"),
            tenant=tenant_of(request),
        )
    )


def api_job(request: Request) -> Response:
    return JSONResponse(page.job_view(state_of(request), request.path_params["job_id"], tenant_of(request)))


def api_job_requests(request: Request) -> Response:
    q = request.query_params
    view = page_requests.requests_view(
        state_of(request),
        request.path_params["job_id"],
        status=q.get("status"),
        outcome=q.get("outcome"),
        q=q.get("q"),
        after=q.get("after"),
        before=q.get("before"),
        limit=_int_param(request, "limit", 25),
        tenant=tenant_of(request),
    )
    return JSONResponse(view)


def api_job_request(request: Request) -> Response:
    p = request.path_params
    return JSONResponse(page_requests.request_view(state_of(request), p["job_id"], p["idx"], tenant_of(request)))


def api_cancel(request: Request) -> Response:
    return JSONResponse(page.cancel_job(state_of(request), request.path_params["job_id"], tenant_of(request)))


def api_workers(request: Request) -> Response:
    return JSONResponse(page.workers_view(state_of(request)))


def prometheus(request: Request) -> Response:
    from prometheus_client import CONTENT_TYPE_LATEST

    return Response(metrics.render(request.app.state.metrics), media_type=CONTENT_TYPE_LATEST)


def healthz(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


# ---- errors, housekeeping, the app ---------------------------------------------------------------------


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return exc.response()


async def _store_error(request: Request, exc: Exception) -> Response:
    log.error("store error on %s %s: %s", request.method, request.url.path, exc)
    return server_error(f"the store failed: {exc}")


async def _redis_error(request: Request, exc: Exception) -> Response:
    return Unavailable(f"{exc}").response()


async def _unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unexpected error on %s %s", request.method, request.url.path)
    return server_error(f"internal error ({type(exc).__name__}); the server log has the details")


async def _not_found(request: Request, exc: Exception) -> Response:
    return NotFound(f"no route {request.method} {clip(request.url.path)}").response()


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own refusals (405 and the like) in the same JSON shape as ours."""
    assert isinstance(exc, HTTPException)
    message = f"{exc.detail}: {request.method} {clip(request.url.path)}"
    body = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}}
    return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)


async def _housekeeping(state: AppState) -> None:
    while True:
        await asyncio.sleep(state.config.sweep_seconds)
        try:
            done = await run_in_threadpool(batches.sweep, state)
            if any(done.values()):
                log.info("housekeeping: %s", done)
        except Exception:
            log.exception("housekeeping failed; trying again in %ss", state.config.sweep_seconds)


class _SecurityHeaders:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def send_with_headers(message: Any) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                headers += [(k.lower().encode(), v.encode()) for k, v in SECURITY_HEADERS.items()]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_headers if scope["type"] == "http" else send)


def create_app(config: ServeConfig, *, housekeeping: bool = True) -> Starlette:
    """The app for `config`. With `housekeeping`, a loop runs batches.sweep every config.sweep_seconds."""
    state = AppState(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        task = asyncio.create_task(_housekeeping(state)) if housekeeping else None
        try:
            yield
        finally:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            state.close()

    routes = [
        Route("/", index),
        Route("/jobs/{job_id}", index),
        Route("/workers", index),
        Route("/healthz", healthz),
        Route("/metrics", prometheus),
        Route("/v1/files", create_file, methods=["POST"]),
        Route("/v1/files", list_files, methods=["GET"]),
        Route("/v1/files/{file_id}", retrieve_file, methods=["GET"]),
        Route("/v1/files/{file_id}", delete_file, methods=["DELETE"]),
        Route("/v1/files/{file_id}/content", file_content, methods=["GET"]),
        Route("/v1/batches", create_batch, methods=["POST"]),
        Route("/v1/batches", list_batches, methods=["GET"]),
        Route("/v1/batches/{batch_id}", retrieve_batch, methods=["GET"]),
        Route("/v1/batches/{batch_id}/cancel", cancel_batch, methods=["POST"]),
        Route("/api/jobs", api_jobs),
        Route("/api/jobs/{job_id}", api_job),
        Route("/api/jobs/{job_id}/requests", api_job_requests),
        Route("/api/jobs/{job_id}/requests/{idx}", api_job_request),
        Route("/api/jobs/{job_id}/cancel", api_cancel, methods=["POST"]),
        Route("/api/workers", api_workers),
        Mount("/static", app=StaticFiles(directory=str(STATIC)), name="static"),
    ]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={
            ApiError: _api_error,
            StoreError: _store_error,
            RedisUnavailable: _redis_error,
            404: _not_found,
            HTTPException: _http_error,
            Exception: _unexpected,
        },
    )
    app.state.omlx = state
    app.state.metrics = metrics.registry_for(state)
    app.add_middleware(Guard, keys=config.api_keys, admin_keys=config.admin_keys)
    app.add_middleware(_SecurityHeaders)
    return app
