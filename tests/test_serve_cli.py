"""`omlx-jobs serve` as a user starts it: a real process on a free loopback port; it refuses to listen beyond
loopback without a key; the app never imports MLX."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from click.testing import CliRunner

from omlx_jobs.cli import cli
from tests.fault_harness import free_port


def _env(tmp_path: Path, redis_url: str) -> dict[str, str]:
    env = {**os.environ, "OMLX_JOBS_HOME": str(tmp_path / "home"), "OMLX_JOBS_REDIS_URL": redis_url}
    for name in ("OMLX_JOBS_DATABASE_URL", "OMLX_JOBS_DB", "OMLX_JOBS_API_KEYS"):
        env.pop(name, None)
    return env


def test_the_app_never_imports_mlx(tmp_path: Path, redis_url: str) -> None:
    code = f"""
import sys, json, urllib.request
from pathlib import Path
from omlx_jobs.api import ServeConfig
from omlx_jobs.cli import cli
from tests.api_harness import live_server
config = ServeConfig(db_url="sqlite:///{tmp_path}/j.db", redis_url="{redis_url}", files_dir=Path("{tmp_path}/f"))
with live_server(config) as url:
    for path in ("/", "/api/jobs", "/api/workers", "/metrics", "/v1/batches", "/v1/files"):
        assert urllib.request.urlopen(url + path).status == 200, path
print(json.dumps(sorted(m for m in sys.modules if m == "mlx" or m.startswith(("mlx.", "mlx_lm", "mlx_vlm")))))
"""
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=root)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_serve_refuses_a_public_address_without_a_key(tmp_path: Path, redis_url: str) -> None:
    result = CliRunner().invoke(cli, ["serve", "--host", "0.0.0.0"], env=_env(tmp_path, redis_url))
    assert result.exit_code == 1
    assert "refusing to listen on 0.0.0.0 without an API key" in result.stderr and "--api-key" in result.stderr
    result = CliRunner().invoke(cli, ["serve", "--api-key", "short"], env=_env(tmp_path, redis_url))
    assert result.exit_code == 1 and "at least 8 characters" in result.stderr


def test_serve_help_explains_every_option() -> None:
    out = CliRunner().invoke(cli, ["serve", "--help"]).output
    for option in (
        "--host",
        "--port",
        "--api-key",
        "--model",
        "--files-dir",
        "--max-upload-bytes",
        "--max-upload-lines",
    ):
        assert option in out
    assert "OMLX_JOBS_API_KEYS" in out and "base_url" in out


def test_serve_runs_with_keys_from_the_environment(tmp_path: Path, redis_url: str) -> None:
    port = free_port()
    env = {**_env(tmp_path, redis_url), "OMLX_JOBS_API_KEYS": "env-key-0000001,env-key-0000002"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "omlx_jobs.cli", "serve", "--port", str(port), "--db", str(tmp_path / "j.db")],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                assert urllib.request.urlopen(f"{base}/healthz", timeout=2).status == 200
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(proc.stdout.read() if proc.stdout else "") from None
                time.sleep(0.1)
        try:
            urllib.request.urlopen(f"{base}/v1/batches", timeout=5)
            raise AssertionError("no key was accepted")
        except urllib.error.HTTPError as exc:
            assert exc.code == 401 and json.loads(exc.read())["error"]["code"] == "missing_api_key"
        req = urllib.request.Request(f"{base}/v1/batches", headers={"Authorization": "Bearer env-key-0000002"})
        assert json.loads(urllib.request.urlopen(req, timeout=5).read())["data"] == []
        page = urllib.request.urlopen(f"{base}/", timeout=5)
        assert "default-src 'self'" in page.headers["Content-Security-Policy"]
        assert (tmp_path / "home" / "files").is_dir()  # the server's own folder, under the data dir
    finally:
        proc.terminate()
        proc.wait(timeout=30)
