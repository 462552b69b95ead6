"""--allow-remote-images fetches only what it may (issue 21, 5 and 6's deadline): real HTTP servers on loopback,
allowed through --allow-remote-hosts; redirects to refused addresses, a dripping server against the total
deadline, byte caps, and error texts that say nothing about what listens on a port."""

from __future__ import annotations

import http.server
import ipaddress
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any, ClassVar
from urllib.parse import urlsplit

import pytest

from omlx_jobs.jobs import images
from omlx_jobs.jobs.fetch import MAX_REDIRECTS, fetch_remote
from omlx_jobs.jobs.images import ImageAccess, ImageSourceError
from omlx_jobs.jobs.remote_hosts import RemoteHosts

PNG = b"\x89PNG\r\n\x1a\n" + b"pixels" * 10


class _Handler(http.server.BaseHTTPRequestHandler):
    routes: ClassVar[dict[str, Any]] = {}

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        route = self.routes.get(urlsplit(self.path).path)
        if route is None:
            self.send_error(404)
            return
        route(self)


def _image(handler: _Handler, body: bytes = PNG, length: bool = True) -> None:
    handler.send_response(200)
    handler.send_header("Content-Type", "image/png")
    if length:
        handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def _redirect(to: str) -> Any:
    def route(handler: _Handler) -> None:
        handler.send_response(302)
        handler.send_header("Location", to)
        handler.send_header("Content-Length", "0")
        handler.end_headers()

    return route


def _drip(handler: _Handler) -> None:
    handler.send_response(200)
    handler.send_header("Content-Length", "1000")
    handler.end_headers()
    try:
        for _ in range(1000):
            handler.wfile.write(b"x")
            handler.wfile.flush()
            time.sleep(0.3)
    except OSError:
        pass  # the client hung up, as it should


@pytest.fixture
def server() -> Iterator[str]:
    class Handler(_Handler):
        routes: ClassVar[dict[str, Any]] = {}

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    base = f"http://127.0.0.1:{httpd.server_address[1]}"
    Handler.routes.update(
        {
            "/img.png": _image,
            "/big.png": lambda h: _image(h, PNG + b"x" * 5000),
            "/big-unsized.png": lambda h: _image(h, PNG + b"x" * 5000, length=False),
            "/hop": _redirect("/img.png"),
            "/to-metadata": _redirect("http://169.254.169.254/latest/meta-data/"),
            "/to-other-loopback": _redirect("http://127.0.0.2:6379/"),
            "/to-mapped": _redirect("http://[::ffff:10.0.0.1]/"),
            "/to-file": _redirect("file:///etc/passwd"),
            "/loop": _redirect("/loop"),
            "/drip": _drip,
        }
    )
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield base
    httpd.shutdown()
    httpd.server_close()


def _loopback_allowed(**kw: Any) -> ImageAccess:
    return ImageAccess.create(allow_remote=True, allow_remote_hosts=["127.0.0.1/32"], **kw)


def _error(url: str, access: ImageAccess) -> ImageSourceError:
    with pytest.raises(ImageSourceError) as exc:
        fetch_remote(url, access)
    return exc.value


def test_loopback_is_refused_unless_allowed(server: str) -> None:
    assert fetch_remote(f"{server}/img.png", _loopback_allowed()) == PNG
    refused = _error(f"{server}/img.png", ImageAccess.create(allow_remote=True))
    assert refused.code == "image_host_not_allowed" and "--allow-remote-hosts" in refused.message
    # A name that resolves to loopback is refused after resolution (submit never sees its address).
    port = urlsplit(server).port
    assert _error(f"http://localhost:{port}/img.png", ImageAccess.create(allow_remote=True)).code == (
        "image_host_not_allowed"
    )
    by_name = ImageAccess.create(allow_remote=True, allow_remote_hosts=["LOCALHOST."])
    assert fetch_remote(f"http://localhost:{port}/img.png", by_name) == PNG


def test_submit_refuses_internal_address_literals() -> None:
    access = ImageAccess.create(allow_remote=True)
    for url in (
        "http://127.0.0.1/a.png",
        "http://[::1]/a.png",
        "http://[::ffff:127.0.0.1]/a.png",
        "http://10.0.0.7/a.png",
        "http://169.254.169.254/latest/meta-data/",
        "http://0.0.0.0:6379/",
        "https://localhost/a.png",
        "http://printer.localhost/a.png",
    ):
        with pytest.raises(ImageSourceError) as exc:
            images.classify(url, access)
        assert exc.value.code == "image_host_not_allowed", url
    assert isinstance(images.classify("https://example.org/a.png", access), images.RemoteImage)
    assert isinstance(images.classify("http://10.0.0.7/a.png", ImageAccess.create(
        allow_remote=True, allow_remote_hosts=["10.0.0.0/8"])), images.RemoteImage)  # fmt: skip


def test_redirects_are_followed_and_checked_at_every_hop(server: str) -> None:
    access = _loopback_allowed()
    assert fetch_remote(f"{server}/hop", access) == PNG
    t0 = time.monotonic()
    # An allowed host sends the fetch to refused ones.
    for route in ("/to-metadata", "/to-other-loopback", "/to-mapped"):
        assert _error(f"{server}{route}", access).code == "image_host_not_allowed", route
    assert time.monotonic() - t0 < 2, "refused before any connection is tried"
    assert _error(f"{server}/to-file", access).code == "image_unreachable"
    loop = _error(f"{server}/loop", access)
    assert loop.code == "image_unreachable" and f"more than {MAX_REDIRECTS} redirects" in loop.message


def test_a_dripping_server_is_cut_at_the_total_deadline(server: str) -> None:
    access = _loopback_allowed(remote_timeout=1.5)
    t0 = time.monotonic()
    err = _error(f"{server}/drip", access)  # a byte every 0.3 s: each read is quick, the whole never ends
    took = time.monotonic() - t0
    assert err.code == "image_unreachable"
    assert 1.4 < took < 3.0, took


def test_a_silent_server_is_cut_at_the_deadline_too() -> None:
    listener = socket.create_server(("127.0.0.1", 0))  # accepts, never answers
    try:
        port = listener.getsockname()[1]
        t0 = time.monotonic()
        err = _error(f"http://127.0.0.1:{port}/a.png", _loopback_allowed(remote_timeout=1.0))
        assert err.code == "image_unreachable" and time.monotonic() - t0 < 2.5
    finally:
        listener.close()


def test_https_goes_to_the_checked_address_and_verifies_tls(server: str) -> None:
    port = urlsplit(server).port
    t0 = time.monotonic()
    err = _error(f"https://127.0.0.1:{port}/img.png", _loopback_allowed())  # a plain-HTTP server: no TLS
    assert err.code == "image_unreachable" and time.monotonic() - t0 < 5


def test_bodies_are_capped(server: str) -> None:
    access = _loopback_allowed(max_bytes=1000)
    for route in ("/big.png", "/big-unsized.png"):  # announced, and not announced
        assert _error(f"{server}{route}", access).code == "image_too_large", route
    assert "HTTP 404" in _error(f"{server}/none.png", access).message


def test_errors_tell_nothing_about_what_listens(redis_url: str) -> None:
    """A closed port, a Redis server and a port that resets: one and the same text."""
    access = _loopback_allowed(remote_timeout=2.0)
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    closed_port = closed.getsockname()[1]
    closed.close()
    resetting = socket.create_server(("127.0.0.1", 0))

    def reset() -> None:
        conn, _ = resetting.accept()
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        conn.close()

    threading.Thread(target=reset, daemon=True).start()
    redis_port = urlsplit(redis_url).port
    texts = {}
    for name, port in (("closed", closed_port), ("redis", redis_port), ("reset", resetting.getsockname()[1])):
        err = _error(f"http://127.0.0.1:{port}/x", access)
        assert err.code == "image_unreachable", name
        texts[name] = err.message.replace(str(port), "PORT")
    resetting.close()
    assert len(set(texts.values())) == 1, texts
    assert "the fetch failed" in texts["closed"]


def test_the_worker_fetches_through_the_checked_path(server: str) -> None:
    from omlx_jobs.worker.vision.inputs.images import ImageError, fetch

    assert fetch(f"{server}/img.png", _loopback_allowed()) == PNG
    with pytest.raises(ImageError) as exc:
        fetch(f"{server}/to-metadata", _loopback_allowed())
    assert exc.value.code == "image_host_not_allowed"


@pytest.mark.parametrize(
    ("address", "public"),
    [
        ("8.8.8.8", True),
        ("2606:4700::1111", True),
        ("2002:808:808::1", True),  # 6to4 of a public address
        ("127.0.0.1", False),
        ("10.1.2.3", False),
        ("172.16.0.1", False),
        ("192.168.1.1", False),
        ("100.64.0.1", False),  # shared (carrier-grade NAT)
        ("169.254.169.254", False),  # link-local: cloud metadata
        ("224.0.0.1", False),
        ("233.1.1.1", False),  # multicast, though "global"
        ("240.0.0.1", False),
        ("0.0.0.0", False),
        ("255.255.255.255", False),
        ("192.0.2.1", False),
        ("::1", False),
        ("::", False),
        ("fe80::1", False),
        ("fc00::1", False),
        ("ff0e::1", False),
        ("::ffff:127.0.0.1", False),
        ("::7f00:1", False),
        ("2002:7f00:1::", False),  # 6to4 of loopback
        ("64:ff9b::a00:1", False),  # NAT64 of 10.0.0.1
    ],
)
def test_which_addresses_are_public(address: str, public: bool) -> None:
    assert RemoteHosts().allows("example.org", ipaddress.ip_address(address)) is public


def test_allow_rules() -> None:
    rules = RemoteHosts.parse(["10.0.0.0/8", "fd00::1", "Intranet.Example."])
    assert rules.allows("a", ipaddress.ip_address("10.9.8.7"))
    assert rules.allows("a", ipaddress.ip_address("::ffff:10.9.8.7"))  # its mapped form
    assert rules.allows("a", ipaddress.ip_address("fd00::1"))
    assert not rules.allows("a", ipaddress.ip_address("fd00::2"))
    assert rules.allows("intranet.example", ipaddress.ip_address("192.168.0.5"))
    assert not rules.allows("other.example", ipaddress.ip_address("192.168.0.5"))
    for bad in ("http://x", "a b", "-x-", ""):
        with pytest.raises(ValueError):
            RemoteHosts.parse([bad])
    with pytest.raises(ValueError, match="needs --allow-remote-images"):
        ImageAccess.create(allow_remote_hosts=["10.0.0.0/8"])
