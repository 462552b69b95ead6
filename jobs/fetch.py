"""Remote images (`--allow-remote-images`), fetched so that a request cannot reach inside the network.

- The host name is resolved once per hop, and every address is checked: loopback, private, link-local,
  shared, multicast, reserved and unspecified addresses (IPv4 and IPv6, IPv4-mapped, 6to4 and NAT64 forms
  too) are refused unless the user allowed that host or network (`--allow-remote-hosts`).
- The connection goes to the very address that was checked (no second resolution), with TLS verified
  against the host name.
- Redirects are followed by hand, at most MAX_REDIRECTS, each hop checked again; only http(s).
- One wall-clock deadline covers the whole image (resolution, connects, redirects, every read): a server
  that drips a byte at a time is cut off when it passes, not after each read.
- The body is capped in bytes. Errors say that the fetch failed and never why the peer closed, so they tell
  nothing about ports behind the host.

Client-side code (standard library only): the worker calls `fetch_remote` through worker/images.py.
"""

from __future__ import annotations

import contextlib
import http.client
import ipaddress
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urljoin, urlsplit

from omlx_jobs.errors import ErrorCode
from omlx_jobs.jobs.images import ImageAccess, ImageSourceError, read_capped

MAX_REDIRECTS = 5
REDIRECTS = (301, 302, 303, 307, 308)
CHUNK = 64 * 1024
USER_AGENT = "omlx-jobs"


@dataclass(frozen=True)
class _Target:
    url: str
    scheme: str
    host: str
    port: int
    path: str


def fetch_remote(url: str, access: ImageAccess) -> bytes:
    """The bytes of an http(s) image URL under `access`'s rules; ImageSourceError with a typed code otherwise."""
    deadline = time.monotonic() + access.remote_timeout
    for _ in range(MAX_REDIRECTS + 1):
        target = _target(url)
        addresses = _checked_addresses(target, access, deadline)
        body, location = _get(target, addresses, access, deadline)
        if location is None:
            return body
        url = urljoin(target.url, location)
    raise _failed(url, f"more than {MAX_REDIRECTS} redirects")


def _target(url: str) -> _Target:
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise ImageSourceError(
            ErrorCode.IMAGE_UNREACHABLE, f"{_what(url)}: a redirect to {scheme or 'no'}: is not followed"
        )
    try:
        port = parts.port or (443 if scheme == "https" else 80)
    except ValueError:
        raise ImageSourceError(ErrorCode.INVALID_IMAGE_URL, f"{_what(url)} has an invalid port") from None
    if not parts.hostname:
        raise ImageSourceError(ErrorCode.INVALID_IMAGE_URL, f"{_what(url)} has no host name")
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return _Target(url, scheme, parts.hostname, port, path)


def _checked_addresses(target: _Target, access: ImageAccess, deadline: float) -> list[str]:
    """The addresses of the host that may be reached, in resolver order; refused if there is none."""
    infos = _resolve(target, deadline)
    allowed: list[str] = []
    for family, _, _, _, sockaddr in infos:
        if family not in (socket.AF_INET, socket.AF_INET6):
            continue
        address = str(sockaddr[0]).split("%", 1)[0]
        if access.remote_hosts.allows(target.host, ipaddress.ip_address(address)) and address not in allowed:
            allowed.append(address)
    if not allowed:
        raise ImageSourceError(
            ErrorCode.IMAGE_HOST_NOT_ALLOWED,
            f"{_what(target.url)}: {target.host} resolves to a loopback, private, link-local or reserved address, "
            "which remote images may not reach; allow the host with --allow-remote-hosts (on the worker) if it is "
            "meant to be fetched",
        )
    return allowed


def _resolve(target: _Target, deadline: float) -> list[Any]:
    """getaddrinfo within the deadline (it has no timeout of its own, so it runs in a thread)."""
    result: dict[str, Any] = {}

    def lookup() -> None:
        try:
            result["infos"] = socket.getaddrinfo(target.host, target.port, type=socket.SOCK_STREAM)
        except OSError as exc:
            result["error"] = exc

    thread = threading.Thread(target=lookup, name="omlx-image-dns", daemon=True)
    thread.start()
    thread.join(max(0.0, deadline - time.monotonic()))
    if "infos" not in result:
        raise _failed(target.url)
    return list(result["infos"])


def _get(target: _Target, addresses: list[str], access: ImageAccess, deadline: float) -> tuple[bytes, str | None]:
    """(body, None), or (b"", the Location of a redirect). Tries each checked address until one connects."""
    for address in addresses:
        watchdog = _Watchdog(deadline)
        conn = _connection(target, address, deadline, watchdog)
        try:
            try:
                conn.request("GET", target.path, headers=_HEADERS)
                response = conn.getresponse()
            except (OSError, http.client.HTTPException):
                if watchdog.fired:
                    raise _failed(target.url) from None
                continue  # this address did not answer: the next one may
            try:
                return _answer(target, response, access, watchdog)
            finally:
                response.close()
        finally:
            watchdog.cancel()
            conn.close()
    raise _failed(target.url)


_HEADERS = {"User-Agent": USER_AGENT, "Accept": "image/*", "Accept-Encoding": "identity", "Connection": "close"}


def _answer(
    target: _Target, response: http.client.HTTPResponse, access: ImageAccess, watchdog: _Watchdog
) -> tuple[bytes, str | None]:
    if response.status in REDIRECTS:
        location = response.getheader("Location")
        if not location:
            raise _failed(target.url, f"HTTP {response.status} without a Location")
        return b"", location
    if response.status != 200:
        raise ImageSourceError(
            ErrorCode.IMAGE_UNREACHABLE, f"{_what(target.url)}: the fetch failed (HTTP {response.status})"
        )
    if response.length is not None and response.length > access.max_bytes:  # its Content-Length, parsed
        raise ImageSourceError(
            ErrorCode.IMAGE_TOO_LARGE,
            f"{_what(target.url)} is {response.length:,} bytes, over {access.max_bytes:,} bytes",
        )
    try:
        body = read_capped(_Reader(response), access.max_bytes, _what(target.url))
    except (OSError, http.client.HTTPException):
        raise _failed(target.url) from None
    if watchdog.fired:  # the watchdog closed the socket: what was read is not the whole image
        raise _failed(target.url)
    return body, None


class _Reader:
    """A file-like `read(n)` over a response that returns what one receive brings (never waits to fill n)."""

    def __init__(self, response: http.client.HTTPResponse) -> None:
        self.response = response

    def read(self, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            chunk = self.response.read1(min(CHUNK, n - len(out)))
            if not chunk:
                break
            out += chunk
        return bytes(out)


class _Watchdog:
    """Shuts the connection's socket down at the deadline, so a blocked connect or read returns at once.

    It holds the socket itself: http.client drops its own reference once a response that closes is read."""

    def __init__(self, deadline: float) -> None:
        self.fired = False
        self.sockets: list[socket.socket] = []
        self._timer = threading.Timer(max(0.0, deadline - time.monotonic()), self._fire)
        self._timer.daemon = True
        self._timer.start()

    def _fire(self) -> None:
        self.fired = True
        for sock in self.sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def cancel(self) -> None:
        self._timer.cancel()


def _connection(target: _Target, address: str, deadline: float, watchdog: _Watchdog) -> http.client.HTTPConnection:
    """A connection to `address` (already checked) that speaks to, and verifies TLS for, the host name."""
    timeout = max(0.001, deadline - time.monotonic())

    def connect(_: Any, timeout: float = timeout, source: Any = None) -> socket.socket:
        sock = socket.create_connection((address, target.port), timeout=timeout)
        watchdog.sockets.append(sock)  # TLS wraps this very descriptor: shutting it down stops the handshake too
        return sock

    conn: http.client.HTTPConnection
    if target.scheme == "https":
        tls = ssl.create_default_context()
        conn = http.client.HTTPSConnection(target.host, target.port, timeout=timeout, context=tls)
    else:
        conn = http.client.HTTPConnection(target.host, target.port, timeout=timeout)
    conn._create_connection = connect  # type: ignore[attr-defined]  # pinned: no second resolution
    return conn


def _failed(url: str, why: str = "") -> ImageSourceError:
    """One text for every way the network can fail (no answer, refused, reset, TLS, the deadline), so it tells
    nothing about what listens where; `why` only for what we decided ourselves (a redirect count)."""
    return ImageSourceError(
        ErrorCode.IMAGE_UNREACHABLE,
        f"{_what(url)}: the fetch failed{f' ({why})' if why else ''}; check that the URL serves "
        "the image within the remote image deadline",
    )


def _what(url: str) -> str:
    return url if len(url) <= 80 else url[:77] + "..."
