"""`serve` against hostile requests (issue 21: 8, 14 and 21's full disk): bodies and upload lines are capped
with a clear 413 while the server's memory stays flat, echoed values are clipped, malformed headers and bodies
are 4xx (never 500), and a full --files-dir is a 507. Real servers: in a thread for the quick checks, and as
`omlx-jobs serve` processes where memory or the disk is measured."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx2 as httpx
import pytest

from omlx_jobs.api import ServeConfig
from tests.api_harness import chat_line, live_server, write_lines
from tests.fault_harness import free_port

KEY = "test-key-123456"
AUTH = {"Authorization": f"Bearer {KEY}"}
MiB = 1024 * 1024
CREATE = {"endpoint": "/v1/chat/completions", "completion_window": "24h"}


@pytest.fixture
def url(tmp_path: Path, store_url: str, redis_url: str) -> Iterator[str]:
    config = ServeConfig(db_url=store_url, redis_url=redis_url, files_dir=tmp_path / "files", api_keys=(KEY,))
    with live_server(config, housekeeping=False) as base:
        yield base


def _form_around(boundary: str, name: str, headers: str = "") -> tuple[bytes, bytes]:
    """The multipart bytes before and after a file's content (a purpose=batch field first)."""
    head = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{name}"\r\n{headers}'
        "Content-Type: application/octet-stream\r\n\r\n"
    )
    return head.encode(), f"\r\n--{boundary}--\r\n".encode()


def _form(boundary: str, name: str, content: bytes, headers: str = "") -> bytes:
    head, tail = _form_around(boundary, name, headers)
    return head + content + tail


def _upload(base: str, content: bytes, boundary: str = "b0undary", headers: str = "") -> httpx.Response:
    return httpx.post(
        f"{base}/v1/files",
        headers={**AUTH, "Content-Type": f"multipart/form-data; boundary={boundary}"},
        content=_form(boundary, "in.jsonl", content, headers),
        timeout=120,
    )


def _chunks(total: int, piece: bytes = b"x" * 65536) -> Iterator[bytes]:
    """A body streamed without Content-Length (chunked): the server cannot refuse it from a header."""
    sent = 0
    while sent < total:
        yield piece
        sent += len(piece)


def test_json_bodies_are_capped_and_parsed_safely(url: str) -> None:
    big = b'{"input_file_id": "' + b"f" * (2 * MiB) + b'"}'
    for resp in (
        httpx.post(f"{url}/v1/batches", headers=AUTH, content=big),  # announced by Content-Length
        httpx.post(f"{url}/v1/batches", headers=AUTH, content=_chunks(3 * MiB)),  # not announced
    ):
        assert resp.status_code == 413 and resp.json()["error"]["code"] == "body_too_large"
    nested = httpx.post(f"{url}/v1/batches", headers=AUTH, content=b"[" * 200_000)
    assert nested.status_code == 422 and "nests too deeply" in nested.json()["error"]["message"]
    long_id = httpx.post(f"{url}/v1/batches", headers=AUTH, json={**CREATE, "input_file_id": "file-" + "a" * 900_000})
    assert long_id.status_code == 404 and len(long_id.content) < 1000, len(long_id.content)  # echoed, clipped
    for params in ({"order": "x" * 50_000}, {"limit": "9" * 50_000}):
        resp = httpx.get(f"{url}/v1/files", headers=AUTH, params=params)
        assert resp.status_code == 400 and len(resp.content) < 1000


def test_malformed_requests_are_4xx_not_500(url: str) -> None:
    assert httpx.get(f"{url}/v1/files", headers={**AUTH, "Host": "["}).status_code == 400
    origin = httpx.post(f"{url}/v1/batches", headers={**AUTH, "Origin": "http://["}, json={})
    assert origin.status_code == 403 and origin.json()["error"]["code"] == "cross_origin_request"
    boundary = _upload(url, b'{"prompt": "hi"}\n', boundary="b" * 300)
    assert boundary.status_code == 422 and "boundary" in boundary.json()["error"]["message"]
    header = _upload(url, b'{"prompt": "hi"}\n', headers=f"X-Pad: {'p' * 100_000}\r\n")
    assert header.status_code == 422
    for params in ({"after": "\x00"}, {"purpose": "\x00"}, {"after": "file-1' OR 1=1"}):  # NUL: PostgreSQL's 500
        resp = httpx.get(f"{url}/v1/files", headers=AUTH, params=params)
        assert resp.status_code == 400, (params, resp.text)
        assert resp.json()["error"]["param"] == next(iter(params))
    assert httpx.get(f"{url}/v1/batches", headers=AUTH, params={"after": "\x00"}).status_code == 400


def test_an_upload_line_is_capped_as_submit_caps_it(url: str, tmp_path: Path) -> None:
    ok_line = b'{"prompt": "' + b"a" * (MiB - 100) + b'"}\n'
    good = _upload(url, b'{"prompt": "hi"}\n' + ok_line)
    assert good.status_code == 200, good.text
    long_line = b'{"prompt": "hi"}\n' + b'{"prompt": "' + b"a" * (2 * MiB) + b'"}\n'
    refused = _upload(url, long_line)
    assert refused.status_code == 413 and refused.json()["error"]["code"] == "line_too_long"
    assert "line 2 " in refused.json()["error"]["message"]
    assert [p.name for p in (tmp_path / "files").iterdir() if p.name.startswith(".upload")] == []


# ---- a real `omlx-jobs serve` process ---------------------------------------------------------------------


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@contextmanager
def _serve(tmp_path: Path, redis_url: str, files_dir: Path, wrap: list[str] | None = None) -> Iterator[Any]:
    port = free_port()
    env = {**os.environ, "OMLX_JOBS_HOME": str(tmp_path / "home"), "OMLX_JOBS_REDIS_URL": redis_url}
    for name in ("OMLX_JOBS_DATABASE_URL", "OMLX_JOBS_DB", "OMLX_JOBS_API_KEYS"):
        env.pop(name, None)
    cmd = [sys.executable, "-m", "omlx_jobs.cli", "serve", "--port", str(port), "--api-key", KEY]
    cmd += ["--db", str(tmp_path / "j.db"), "--files-dir", str(files_dir)]
    log = (tmp_path / "serve.log").open("wb")
    proc = subprocess.Popen((wrap or []) + cmd, env=env, stdout=log, stderr=log)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{base}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError((tmp_path / "serve.log").read_text()[-3000:])
            time.sleep(0.2)
        proc.base = base  # type: ignore[attr-defined]
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_oversized_bodies_leave_the_servers_memory_flat(tmp_path: Path, redis_url: str) -> None:
    with _serve(tmp_path, redis_url, tmp_path / "files") as proc:
        base = proc.base
        httpx.get(f"{base}/v1/files", headers=AUTH)  # warm: routes, the store
        before = _rss_mb(proc.pid)
        body = httpx.post(f"{base}/v1/batches", headers=AUTH, content=_chunks(200 * MiB), timeout=120)
        assert body.status_code == 413 and body.json()["error"]["code"] == "body_too_large"
        line = (b'{"prompt": "' + b"a" * 65536 for _ in range(3200))  # one 200 MiB line, streamed

        def form() -> Iterator[bytes]:
            head, tail = _form_around("b0undary", "one-line.jsonl")
            yield head
            yield from line
            yield b'"}\n' + tail

        upload = httpx.post(f"{base}/v1/files", content=form(), timeout=120,
                            headers={**AUTH, "Content-Type": "multipart/form-data; boundary=b0undary"})  # fmt: skip
        assert upload.status_code == 413 and upload.json()["error"]["code"] == "line_too_long"
        for _ in range(5):
            echo = httpx.post(f"{base}/v1/batches", headers=AUTH, json={**CREATE, "input_file_id": "x" * 1_000_000})
            assert echo.status_code == 404 and len(echo.content) < 1000
        after = _rss_mb(proc.pid)
        print(f"serve RSS: {before:.1f} MB before, {after:.1f} MB after 200 MiB body, 200 MiB line, 5 x 1 MB ids")
        assert after - before < 60, (before, after)


def _can_mount_tmpfs() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs none /mnt"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.skipif(not _can_mount_tmpfs(), reason="needs unshare -rm to mount a small tmpfs")
def test_a_full_files_dir_answers_507(tmp_path: Path, redis_url: str) -> None:
    files = tmp_path / "files"
    files.mkdir()
    wrap = ["unshare", "-rm", "sh", "-c", f'mount -t tmpfs -o size=1m tmpfs "{files}" && exec "$0" "$@"']
    src = write_lines(tmp_path / "in.jsonl", [chat_line(i, extra_pad="x" * 900) for i in range(3000)])
    with _serve(tmp_path, redis_url, files, wrap=wrap) as proc:
        resp = _upload(proc.base, src.read_bytes())
        assert resp.status_code == 507, resp.text
        assert (
            resp.json()["error"]["code"] == "insufficient_storage" and "disk is full" in resp.json()["error"]["message"]
        )
        small = _upload(proc.base, b'{"prompt": "hi"}\n')  # the refused upload left nothing behind
        assert small.status_code == 200, small.text


def test_an_uploads_scan_stores_a_bounded_summary(tmp_path: Path) -> None:
    from omlx_jobs.api.models import MAX_SCANNED_NAMES, resolve_model, scan_file

    lines = [chat_line(0, model="m" * 50_000)] + [chat_line(i, model=f"model-{i}") for i in range(1, 40)]
    lines += [{**chat_line(99), "url": "/v1/" + "u" * 50_000}, '{"model": ' * 5000]  # and one nested too deeply
    scan = scan_file(write_lines(tmp_path / "in.jsonl", lines))
    assert len(scan.models) == MAX_SCANNED_NAMES and scan.model_count == 41 and len(scan.urls) <= MAX_SCANNED_NAMES
    assert len(str(scan.to_dict())) < 2000
    with pytest.raises(Exception, match="names 41 models") as exc:
        resolve_model(scan.models, {}, [], scan.model_count)
    assert len(str(exc.value)) < 1000
