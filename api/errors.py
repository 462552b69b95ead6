"""API errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}, with their HTTP status."""

from __future__ import annotations

from typing import Any, ClassVar

from starlette.responses import JSONResponse

from omlx_jobs.errors import ErrorCode

MAX_ECHO_CHARS = 200


def clip(value: object, limit: int = MAX_ECHO_CHARS) -> str:
    """A value a client sent, cut short for an error message: a 10 MB id must not come back as a 10 MB 404."""
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


class ApiError(Exception):
    """An error the client can act on; `message` says what was wrong and what to do."""

    status = 400
    type = "invalid_request_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=getattr(self, "headers", None))


class BadRequest(ApiError):
    status = 400


class Unauthorized(ApiError):
    status = 401
    type = "authentication_error"
    headers: ClassVar[dict[str, str]] = {"WWW-Authenticate": 'Bearer realm="omlx-jobs"'}


class Forbidden(ApiError):
    status = 403
    type = "permission_error"


class NotFound(ApiError):
    status = 404


class TooLarge(ApiError):
    status = 413


class InsufficientStorage(ApiError):
    """The server's disk is full: nothing was stored; try again once space is freed."""

    status = 507
    type = "server_error"


class Unprocessable(ApiError):
    """The request parsed but cannot be acted on as given (a malformed form or JSON body)."""

    status = 422


class Unavailable(ApiError):
    """Redis or the database is down; retrying later can work."""

    status = 503
    type = "server_error"


def server_error(message: str) -> JSONResponse:
    """A 500 that names what failed without a traceback."""
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": ErrorCode.SERVER_ERROR}}
    return JSONResponse(body, status_code=500)
