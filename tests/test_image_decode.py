"""Worker-side images: fetch (re-checked), decode with limits, identity; a loopback HTTP server for remote cases."""

from __future__ import annotations

import base64
import io
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from PIL import Image

from omlx_jobs.jobs.images import ImageAccess
from omlx_jobs.jobs.parts import image_urls
from omlx_jobs.worker.models.loaded import check_accepts_images
from omlx_jobs.worker.prompts import ImageError
from omlx_jobs.worker.vision.inputs import images
from omlx_jobs.worker.vision.inputs.images import ImageLimits

LOOPBACK = ["127.0.0.1"]  # the test servers' address: refused for remote images unless allowed


def encoded(img: Image.Image, fmt: str = "PNG", **kw: object) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def uri(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


def gradient(w: int = 40, h: int = 24, seed: int = 0) -> Image.Image:
    img = Image.new("RGB", (w, h))
    img.putdata([((x * 7 + seed) % 256, (y * 11) % 256, (x * y + seed * 3) % 256) for y in range(h) for x in range(w)])
    return img


def code_of(fn, *args, **kw) -> str:  # type: ignore[no-untyped-def]
    with pytest.raises(ImageError) as exc:
        fn(*args, **kw)
    assert exc.value.message  # says what happened and what to do
    return exc.value.code


# ---- decoding ---------------------------------------------------------------------------------------


def test_decode_png_jpeg_webp_gif_to_rgb() -> None:
    for fmt in ("PNG", "JPEG", "WEBP", "GIF"):
        got = images.decode(encoded(gradient(), fmt))
        assert (got.width, got.height) == (40, 24)
        assert got.pixels.mode == "RGB"


def test_identity_is_the_decoded_pixels_and_size() -> None:
    a = images.decode(encoded(gradient(seed=1)))
    same_pixels_other_file = images.decode(encoded(gradient(seed=1).convert("RGBA")))
    other = images.decode(encoded(gradient(seed=2)))
    assert a.digest == same_pixels_other_file.digest
    assert a.digest != other.digest
    # same pixel bytes, other shape: a different image
    flat = Image.frombytes("RGB", (24, 40), gradient(seed=1).tobytes())
    assert images.decode(encoded(flat)).digest != a.digest


def test_exif_orientation_is_applied() -> None:
    img = gradient(40, 20)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise when shown
    got = images.decode(encoded(img, "JPEG", exif=exif))
    assert (got.width, got.height) == (20, 40)


def test_palette_and_alpha_become_rgb() -> None:
    assert images.decode(encoded(gradient().convert("P"))).pixels.mode == "RGB"
    assert images.decode(encoded(Image.new("LA", (5, 5)))).pixels.mode == "RGB"


def test_not_an_image() -> None:
    assert code_of(images.decode, b"hello, this is text") == "invalid_image"
    # a PNG signature on garbage
    assert code_of(images.decode, b"\x89PNG\r\n\x1a\n" + b"\0" * 40) in ("invalid_image", "truncated_image")


def test_truncated_files(tmp_path: Path) -> None:
    for fmt in ("PNG", "JPEG"):
        data = encoded(gradient(64, 64), fmt)
        path = tmp_path / f"cut.{fmt.lower()}"
        path.write_bytes(data[: len(data) * 2 // 3])
        assert code_of(images.decode, path.read_bytes()) == "truncated_image", fmt


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height pixels, with a tiny IDAT: a bomb in 60 bytes."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def test_decompression_bombs_fail_fast() -> None:
    started = time.perf_counter()
    # over our limit, under Pillow's own bomb threshold: refused from the header
    assert code_of(images.decode, _png_header_only(10_000, 10_000)) == "image_too_many_pixels"
    # over Pillow's threshold (2 x 89M pixels): Pillow refuses at open
    assert code_of(images.decode, _png_header_only(100_000, 100_000)) == "image_too_many_pixels"
    # a real, small file that decodes to 48M pixels (1-bit PNG, about 6 KB)
    bomb = encoded(Image.new("1", (8000, 6000)))
    assert len(bomb) < 100_000
    assert code_of(images.decode, bomb) == "image_too_many_pixels"
    assert time.perf_counter() - started < 5


def test_pixel_limit_is_configurable() -> None:
    data = encoded(gradient(40, 24))
    assert code_of(images.decode, data, ImageLimits(max_pixels=40 * 24 - 1)) == "image_too_many_pixels"
    assert images.decode(data, ImageLimits(max_pixels=40 * 24)).width == 40


# ---- fetching: data URIs, confined files ----------------------------------------------------------


def test_data_uri_and_file_give_the_same_image(tmp_path: Path) -> None:
    data = encoded(gradient())
    (tmp_path / "a.png").write_bytes(data)
    access = ImageAccess.create([tmp_path])
    assert images.load_image(uri(data), access).digest == images.load_image(str(tmp_path / "a.png"), access).digest
    assert images.load_image(f"file://{tmp_path}/a.png", access).width == 40


def test_worker_refuses_files_its_own_list_does_not_allow(tmp_path: Path) -> None:
    (tmp_path / "a.png").write_bytes(encoded(gradient()))
    assert code_of(images.load_image, str(tmp_path / "a.png"), ImageAccess()) == "image_path_not_allowed"
    inner = tmp_path / "inner"
    inner.mkdir()
    (inner / "link.png").symlink_to(tmp_path / "a.png")
    access = ImageAccess.create([inner])
    assert code_of(images.load_image, str(inner / "link.png"), access) == "image_path_not_allowed"


def test_file_over_the_byte_cap(tmp_path: Path) -> None:
    (tmp_path / "a.png").write_bytes(encoded(gradient()))
    access = ImageAccess.create([tmp_path], max_bytes=100)
    assert code_of(images.load_image, str(tmp_path / "a.png"), access) == "image_too_large"


def test_image_sent_to_a_text_only_model() -> None:
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,x"}}]}]
    with pytest.raises(ImageError) as exc:
        check_accepts_images(msgs, model_is_vision=False, model="tiny-qwen3")
    assert exc.value.code == "images_not_supported" and "tiny-qwen3" in exc.value.message
    check_accepts_images(msgs, model_is_vision=True, model="vlm")
    check_accepts_images([{"role": "user", "content": "hi"}], model_is_vision=False, model="m")


def test_image_urls_in_prompt_order() -> None:
    part = {"type": "image_url", "image_url": {"url": "u1"}}
    msgs = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, part]},
        {"role": "user", "content": [{**part, "image_url": {"url": "u2"}}]},
    ]
    assert list(image_urls(msgs)) == [(1, 1, "u1"), (2, 0, "u2")]


# ---- remote images against a loopback server -------------------------------------------------------


class _Server:
    def __init__(self, routes: dict[str, tuple[int, dict[str, str], bytes, float]]) -> None:
        self.routes = routes
        self.connections = 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                status, headers, body, delay = server.routes.get(self.path, (404, {}, b"", 0.0))
                time.sleep(delay)
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", headers.get("Content-Length", str(len(body))))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        class CountingServer(ThreadingHTTPServer):
            daemon_threads = True

            def verify_request(self, request: object, client_address: object) -> bool:
                server.connections += 1
                return True

            def handle_error(self, request: object, client_address: object) -> None:
                pass  # a client that gave up early (the size cap, the timeout) breaks the pipe: expected

        self.httpd = CountingServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[_Server]:
    png = encoded(gradient())
    (tmp_path / "secret.png").write_bytes(png)
    s = _Server(
        {
            "/a.png": (200, {"Content-Type": "image/png"}, png, 0.0),
            "/slow.png": (200, {}, png, 3.0),
            "/big.png": (200, {"Content-Length": str(50 * 1024 * 1024)}, b"", 0.0),
            "/moved": (302, {"Location": "/a.png"}, b"", 0.0),
            "/to-file": (302, {"Location": f"file://{tmp_path}/secret.png"}, b"", 0.0),
            "/text": (200, {}, b"<html>not an image</html>", 0.0),
        }
    )
    yield s
    s.close()


def test_remote_off_never_connects(server: _Server) -> None:
    assert code_of(images.load_image, f"{server.url}/a.png", ImageAccess()) == "remote_images_disabled"
    assert server.connections == 0


def test_remote_on_fetches_and_follows_http_redirects(server: _Server) -> None:
    access = ImageAccess.create(allow_remote=True, allow_remote_hosts=LOOPBACK)
    got = images.load_image(f"{server.url}/a.png", access)
    assert got.digest == images.decode(encoded(gradient())).digest
    assert images.load_image(f"{server.url}/moved", access).digest == got.digest
    assert server.connections >= 2


def test_remote_failures(server: _Server) -> None:
    access = ImageAccess.create(allow_remote=True, remote_timeout=0.5, allow_remote_hosts=LOOPBACK)
    assert code_of(images.load_image, f"{server.url}/missing.png", access) == "image_unreachable"
    started = time.perf_counter()
    assert code_of(images.load_image, f"{server.url}/slow.png", access) == "image_unreachable"
    assert time.perf_counter() - started < 2.5
    assert code_of(images.load_image, f"{server.url}/big.png", access) == "image_too_large"
    assert code_of(images.load_image, f"{server.url}/to-file", access) == "image_unreachable"
    assert code_of(images.load_image, f"{server.url}/text", access) == "invalid_image"


def test_unreachable_host() -> None:
    # a port nothing listens on: connection refused at once
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    access = ImageAccess.create(allow_remote=True, remote_timeout=1, allow_remote_hosts=LOOPBACK)
    assert code_of(images.load_image, f"http://127.0.0.1:{port}/x.png", access) == "image_unreachable"


def test_every_worker_code_is_listed() -> None:
    assert {"truncated_image", "image_too_many_pixels", "image_unreachable", "images_not_supported"} <= (
        images.IMAGE_ERROR_CODES
    )


# ---- end to end: one image request to a text-only model fails alone -------------------------------


def test_run_image_request_on_a_text_model_fails_alone(tmp_path: Path, tiny_model_dir: Path) -> None:
    import json

    from click.testing import CliRunner

    from omlx_jobs.cli import cli

    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "a.png").write_bytes(encoded(gradient()))
    img_part = {"type": "image_url", "image_url": {"url": str(tmp_path / "pics" / "a.png")}}
    lines = [
        {"custom_id": "text", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 3},
        {"custom_id": "image", "messages": [{"role": "user", "content": [img_part, {"type": "text", "text": "?"}]}]},
    ]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    env = {"OMLX_JOBS_DB": str(tmp_path / "jobs.db"), "OMLX_JOBS_REDIS_URL": "redis://127.0.0.1:1/0"}
    args = ["run", str(tmp_path / "in.jsonl"), "-m", str(tiny_model_dir), "-o", str(tmp_path / "out.jsonl")]
    result = CliRunner().invoke(cli, [*args, "--allow-files-from", str(tmp_path / "pics")], env=env)
    assert result.exit_code == 0, result.stderr
    out = {x["custom_id"]: x for x in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    assert out["text"]["response"]["status_code"] == 200
    error = out["image"]["response"]["body"]["error"]
    assert error["code"] == "images_not_supported" and "text-only" in error["message"]
