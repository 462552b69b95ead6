"""The request guard: bearer keys (constant-time), cross-origin writes refused, and Host checked when there
is no key.

The browser page authenticates the same way as API clients: the key, typed once into the page, stays in the
tab's sessionStorage and goes in an Authorization header. No cookie is ever set, so another site cannot make
the browser send a credential (no CSRF by construction); writes that carry a foreign Origin are refused too,
which also covers a keyless server on loopback. Without a key, a Host that is not a loopback name is refused,
so a DNS-rebinding page cannot reach the server through a name of its own.
"""

from __future__ import annotations

import hmac
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from omlx_jobs.api.config import is_loopback
from omlx_jobs.api.errors import ApiError, Forbidden, Unauthorized

PROTECTED_PREFIXES = ("/v1/", "/api/", "/metrics")
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def key_matches(token: str, keys: tuple[str, ...]) -> bool:
    """Compare against every key, each in constant time, without stopping at the first match."""
    found = False
    for key in keys:
        found |= hmac.compare_digest(token.encode(), key.encode())
    return found


def check(method: str, path: str, headers: Headers, keys: tuple[str, ...]) -> None:
    """Raise the ApiError that refuses this request, if any."""
    host = headers.get("host", "")
    if not keys and host and not is_loopback(urlsplit(f"//{host}").hostname or ""):
        raise Forbidden(
            f"this server has no API key, so it answers only to loopback host names, not {host!r}; "
            "start it with --api-key to serve other names",
            code="host_not_allowed",
        )
    if method not in SAFE_METHODS:
        origin = headers.get("origin")
        if origin and origin != "null" and urlsplit(origin).netloc != host:
            raise Forbidden(f"cross-origin request from {origin!r} refused", code="cross_origin_request")
        if headers.get("sec-fetch-site") == "cross-site" or origin == "null":
            raise Forbidden("cross-site request refused", code="cross_origin_request")
    if not keys or not path.startswith(PROTECTED_PREFIXES):
        return
    scheme, _, token = headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthorized(
            "no API key given: send the header 'Authorization: Bearer KEY' (the openai client's api_key)",
            code="missing_api_key",
        )
    if not key_matches(token.strip(), keys):
        raise Unauthorized("incorrect API key provided", code="invalid_api_key")


class Guard:
    """ASGI middleware running `check` before every HTTP request."""

    def __init__(self, app: ASGIApp, keys: tuple[str, ...]) -> None:
        self.app, self.keys = app, keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            try:
                check(scope["method"], scope["path"], Headers(scope=scope), self.keys)
            except ApiError as exc:
                await exc.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)
