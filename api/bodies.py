"""JSON request bodies, read under a byte cap: a client cannot make the server hold more than MAX_JSON_BYTES
of one, nor nest it deep enough to exhaust the parser's stack."""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request

from omlx_jobs.api.errors import TooLarge, Unprocessable, clip
from omlx_jobs.api.uploads import drain

MAX_JSON_BYTES = 1024 * 1024
"""A batch create is a few hundred bytes; 1 MiB leaves room for metadata and anything a client adds."""


async def json_body(request: Request, max_bytes: int = MAX_JSON_BYTES) -> dict[str, Any]:
    """The request's JSON object; 413 past `max_bytes` (announced or not), 422 if it is not a JSON object."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > max_bytes:
        await drain(request.stream(), 0)
        raise _too_large(max_bytes)
    data = bytearray()
    stream = request.stream()
    async for chunk in stream:
        data += chunk
        if len(data) > max_bytes:
            await drain(stream, 0)
            raise _too_large(max_bytes)
    try:
        body = json.loads(bytes(data) or b"null")
    except RecursionError:
        raise Unprocessable("the request body nests too deeply to be read; send a flat JSON object") from None
    except ValueError as exc:
        raise Unprocessable(f"the request body is not valid JSON: {clip(str(exc))}") from None
    if not isinstance(body, dict):
        raise Unprocessable("the request body must be a JSON object")
    return body


def _too_large(max_bytes: int) -> TooLarge:
    return TooLarge(
        f"the request body is over {max_bytes:,} bytes; a JSON body here is a few hundred", code="body_too_large"
    )
