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
from omlx_jobs.api.errors import ApiError, BadRequest, Forbidden, Unauthorized, clip
from omlx_jobs.api.tenants import EVERYONE, SCOPE_KEY, Tenant, key_id

PROTECTED_PREFIXES = ("/v1/", "/api/", "/metrics")
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def key_matches(token: str, keys: tuple[str, ...]) -> bool:
    """Compare against every key, each in constant time, without stopping at the first match."""
    return matching_key(token, keys) is not None


def matching_key(token: str, keys: tuple[str, ...]) -> str | None:
    """The key `token` equals, compared with every key in constant time; None if none."""
    found = None
    for key in keys:
        if hmac.compare_digest(token.encode(), key.encode()):
            found = key
    return found


def _host_name(host: str) -> str | None:
    """The name in a Host header (without port), or None if it is malformed (`[`, `a:b:c`)."""
    try:
        return urlsplit(f"//{host}").hostname or ""
    except ValueError:
        return None


def _netloc(origin: str) -> str | None:
    try:
        return urlsplit(origin).netloc
    except ValueError:
        return None


def check(method: str, path: str, headers: Headers, keys: tuple[str, ...], admin_keys: tuple[str, ...] = ()) -> Tenant:
    """The Tenant of this request, or raise the ApiError that refuses it."""
    host = headers.get("host", "")
    name = _host_name(host)
    if name is None:
        raise BadRequest("the Host header is malformed", code="invalid_host")
    everyone = (*keys, *admin_keys)
    if not everyone and host and not is_loopback(name):
        raise Forbidden(
            f"this server has no API key, so it answers only to loopback host names, not {clip(host)!r}; "
            "start it with --api-key to serve other names",
            code="host_not_allowed",
        )
    if method not in SAFE_METHODS:
        origin = headers.get("origin")
        if origin and origin != "null" and _netloc(origin) != host:
            raise Forbidden(f"cross-origin request from {clip(origin)!r} refused", code="cross_origin_request")
        if headers.get("sec-fetch-site") == "cross-site" or origin == "null":
            raise Forbidden("cross-site request refused", code="cross_origin_request")
    if not everyone or not path.startswith(PROTECTED_PREFIXES):
        return EVERYONE
    scheme, _, token = headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthorized(
            "no API key given: send the header 'Authorization: Bearer KEY' (the openai client's api_key)",
            code="missing_api_key",
        )
    key = matching_key(token.strip(), everyone)
    if key is None:
        raise Unauthorized("incorrect API key provided", code="invalid_api_key")
    return Tenant(key_id(key), admin=matching_key(key, admin_keys) is not None)


class Guard:
    """ASGI middleware running `check` before every HTTP request; it leaves the Tenant in the scope."""

    def __init__(self, app: ASGIApp, keys: tuple[str, ...], admin_keys: tuple[str, ...] = ()) -> None:
        self.app, self.keys, self.admin_keys = app, keys, admin_keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            try:
                tenant = check(scope["method"], scope["path"], Headers(scope=scope), self.keys, self.admin_keys)
            except ApiError as exc:
                await exc.response()(scope, receive, send)
                return
            scope.setdefault("state", {})[SCOPE_KEY] = tenant
        await self.app(scope, receive, send)
