"""Image jobs end to end: CLI submit to a real Redis and store, a real burst worker process on a tiny random
Qwen2-VL, results exported. Every bad-image case fails its request alone, with its code, and the rest of the job
goes on; the worker confines files to its own --allow-files-from folders, symlinks included."""

from __future__ import annotations

import base64
import io
import json
import os
import struct
import zlib
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mlx_vlm")

from PIL import Image

from tests.test_cli_worker import burst_worker, invoke
from tests.tiny_vlm import build_tiny_vlm


@pytest.fixture
def env(tmp_path: Path, redis_url: str) -> dict[str, str]:
    e = dict(os.environ)
    e.update({"OMLX_JOBS_DB": str(tmp_path / "jobs.db"), "OMLX_JOBS_REDIS_URL": redis_url})
    e["OMLX_JOBS_HOME"] = str(tmp_path / "home")
    e.pop("OMLX_JOBS_DATABASE_URL", None)
    return e


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_vlm(tmp_path_factory.mktemp("qwen2_vl"))


def png(w: int = 64, h: int = 48, color: tuple[int, int, int] = (200, 30, 30)) -> bytes:
    buf = io.BytesIO()
    img = Image.new("RGB", (w, h), color)
    img.putpixel((1, 1), (0, 0, 0))
    img.save(buf, "PNG")
    return buf.getvalue()


def bomb_png(w: int = 20_000, h: int = 20_000) -> bytes:
    """A valid PNG header that claims 400 megapixels (no pixel data): a decompression bomb."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


SYSTEM = "You are a helpful assistant. Answer briefly and clearly, in a few words."


def line(cid: str, url: str | None, question: str = "What is in this picture?", system: bool = False) -> str:
    parts: list[dict[str, Any]] = [{"type": "text", "text": question}]
    if url is not None:
        parts.insert(0, {"type": "image_url", "image_url": {"url": url, "detail": "auto"}})
    messages = [{"role": "system", "content": SYSTEM}] * system + [{"role": "user", "content": parts}]
    body = {"messages": messages, "max_tokens": 4, "temperature": 0}
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body})


def results(env: dict[str, str], job: str, tmp_path: Path) -> tuple[dict[str, Any], dict[str, str]]:
    code, _, err = invoke(
        env, "results", job, "-o", str(tmp_path / "ok.jsonl"), "--errors", str(tmp_path / "err.jsonl")
    )
    assert code == 0, err
    ok = {x["custom_id"]: x for x in map(json.loads, (tmp_path / "ok.jsonl").read_text().splitlines())}
    bad = [json.loads(x) for x in (tmp_path / "err.jsonl").read_text().splitlines()]
    return ok, {x["custom_id"]: x["response"]["body"]["error"]["code"] for x in bad}


def test_bad_images_fail_alone_and_the_job_goes_on(tmp_path: Path, env: dict[str, str], vlm_dir: Path) -> None:
    allowed, submit_only = tmp_path / "allowed", tmp_path / "submit_only"
    allowed.mkdir()
    submit_only.mkdir()
    (allowed / "good.png").write_bytes(png())
    (allowed / "later_junk.png").write_bytes(png())  # replaced by junk after submit: the worker decodes it
    (allowed / "later_big.png").write_bytes(png())
    (allowed / "truncated.png").write_bytes(png(200, 150)[:300])
    (allowed / "bomb.png").write_bytes(bomb_png())
    (submit_only / "elsewhere.png").write_bytes(png(color=(0, 0, 250)))
    (allowed / "link.png").symlink_to(submit_only / "elsewhere.png")  # points out of the worker's folder
    uri = "data:image/png;base64," + base64.b64encode(png(color=(20, 200, 20))).decode()
    lines = [
        line("data", uri),
        line("file", str(allowed / "good.png")),
        line("file-url", (allowed / "good.png").as_uri(), "Describe it."),
        line("text", None, "Name three colors."),
        line("junk", str(allowed / "later_junk.png")),
        line("big", str(allowed / "later_big.png")),
        line("truncated", str(allowed / "truncated.png")),
        line("bomb", str(allowed / "bomb.png")),
        line("outside", str(submit_only / "elsewhere.png")),
        line("symlink", str(allowed / "link.png")),
        line("remote", "http://127.0.0.1:9/picture.png"),
        line("data-again", uri, "Is it a photo?"),
        line("asked-1", uri, "What colors do you see?", system=True),
        line("asked-2", uri, "Is there any text in it?", system=True),
    ]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    code, out, err = invoke(
        env,
        "submit",
        str(tmp_path / "in.jsonl"),
        "--model",
        str(vlm_dir),
        "--allow-files-from",
        str(allowed),
        "--allow-files-from",
        str(submit_only),
        "--allow-remote-images",
        "--allow-remote-hosts",  # the test's URL is on loopback, refused by default
        "127.0.0.1",
    )
    assert code == 0, err
    job = out.strip()
    (allowed / "later_junk.png").write_bytes(b"this is not an image at all" * 10)
    (allowed / "later_big.png").write_bytes(png() + b"\0" * (21 * 1024 * 1024))  # over the 20 MB cap

    proc = burst_worker(env, vlm_dir, "--allow-files-from", str(allowed))  # remote images off on this worker
    assert proc.returncode == 0, proc.stderr[-3000:]

    code, out, _ = invoke(env, "status", job, "--json")
    status = json.loads(out)
    assert status["status"] == "completed"  # bad images never fail their job
    assert status["request_counts"]["completed"] == 7 and status["request_counts"]["failed"] == 7
    ok, codes = results(env, job, tmp_path)
    assert sorted(ok) == ["asked-1", "asked-2", "data", "data-again", "file", "file-url", "text"]
    assert codes == {
        "junk": "invalid_image",
        "big": "image_too_large",
        "truncated": "truncated_image",
        "bomb": "image_too_many_pixels",
        "outside": "image_path_not_allowed",
        "symlink": "image_path_not_allowed",
        "remote": "remote_images_disabled",
    }
    usage = {cid: x["response"]["body"]["usage"] for cid, x in ok.items()}
    assert usage["data"]["prompt_tokens"] > usage["text"]["prompt_tokens"] + 4  # image tokens are prompt tokens
    # the same image after the same system prompt: computed once, charged to the first question that uses it
    # (worker/engine/charges.py) and reported as cached for the other
    from omlx_jobs.worker.loading import load

    prompt = load(str(vlm_dir)).prompt("/v1/chat/completions", json.loads(lines[-1])["body"])
    image_end = prompt.media[0].start + prompt.media[0].length
    cached = [usage[c]["prompt_tokens_details"]["cached_tokens"] for c in ("asked-1", "asked-2")]
    assert min(cached) < image_end <= max(cached) and usage["asked-2"]["prompt_tokens"] == len(prompt)


def test_unreachable_url_and_a_text_model(
    tmp_path: Path, env: dict[str, str], vlm_dir: Path, tiny_model_dir: Path
) -> None:
    uri = "data:image/png;base64," + base64.b64encode(png()).decode()
    (tmp_path / "in.jsonl").write_text(
        line("remote", "http://127.0.0.1:9/picture.png") + "\n" + line("data", uri) + "\n"
    )
    code, _, err = invoke(
        env,
        "run",
        str(tmp_path / "in.jsonl"),
        "--model",
        str(vlm_dir),
        "--allow-remote-images",
        "--allow-remote-hosts",
        "127.0.0.1",
        "-o",
        str(tmp_path / "out.jsonl"),
    )
    assert code == 0, err
    out = {x["custom_id"]: x for x in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    assert out["remote"]["response"]["body"]["error"]["code"] == "image_unreachable"
    assert out["data"]["response"]["status_code"] == 200

    code, job, err = invoke(
        env,
        "submit",
        str(tmp_path / "in.jsonl"),
        "--model",
        str(tiny_model_dir),
        "--allow-remote-images",
        "--allow-remote-hosts",
        "127.0.0.1",
    )
    assert code == 0, err
    proc = burst_worker(env, tiny_model_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _, codes = results(env, job.strip(), tmp_path)
    assert codes == {"remote": "images_not_supported", "data": "images_not_supported"}
