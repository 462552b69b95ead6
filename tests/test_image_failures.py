"""One image never fails its shard (issue 21, finding 1): an image the processor refuses (a 1x300 PNG: Qwen2-VL's
"absolute aspect ratio must be smaller than 200") and a JPEG whose EXIF block makes Pillow raise struct.error
fail their own requests, with a typed code, while planning goes on: the other image and the text-only requests
of the same shard complete. Running the shard again (retry, resume) settles nothing twice and never loops.
Also: the same size is refused at submit, from the header alone, with the line and field named."""

from __future__ import annotations

import base64
import io
import json
import struct
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mlx_vlm")

from PIL import Image

from omlx_jobs.jobs import lifecycle
from omlx_jobs.jobs.images import ImageAccess
from omlx_jobs.jobs.submit import load_job
from omlx_jobs.store import RequestStatus, Store
from omlx_jobs.worker import loading
from omlx_jobs.worker.engine.config import EngineConfig
from omlx_jobs.worker.engine.loop import Engine
from omlx_jobs.worker.prompts import ImageError
from omlx_jobs.worker.runtime.shard import run_shard
from omlx_jobs.worker.vision.inputs.images import decode
from omlx_jobs.worker.vision.inputs.media import ImageMemo, ImageRef, PixelCache
from omlx_jobs.worker.vision.loaded import VisionLoaded
from tests.tiny_vlm import build_tiny_vlm

# An EXIF block (Orientation 6, an Exif IFD, a Make) with a few bytes flipped: ImageOps.exif_transpose raises
# struct.error("required argument is not an integer") on it (found by mutating, Pillow 13).
BAD_EXIF = bytes.fromhex(
    "4578696600004578696600004d4d002a000000080003015300020000000463616d000112000300000001000600008769000400"
    "00000100000032000000000001860300020000000b0000004400000000323032303a30313a30310000"
)


def image(w: int, h: int, fmt: str = "PNG", color: tuple[int, int, int] = (200, 30, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), color).save(buf, fmt)
    return buf.getvalue()


def bad_exif_jpeg() -> bytes:
    data = image(32, 32, "JPEG", (9, 99, 199))
    return data[:2] + b"\xff\xe1" + struct.pack(">H", len(BAD_EXIF) + 2) + BAD_EXIF + data[2:]


def line(cid: str, url: str | None, question: str = "What is in this picture?") -> str:
    parts: list[dict[str, Any]] = [{"type": "text", "text": question}]
    if url is not None:
        parts.insert(0, {"type": "image_url", "image_url": {"url": url}})
    body = {"messages": [{"role": "user", "content": parts}], "max_tokens": 3, "temperature": 0}
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body})


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> VisionLoaded:
    out = loading.load(str(build_tiny_vlm(tmp_path_factory.mktemp("qwen2_vl"))))
    assert isinstance(out, VisionLoaded)
    return out


def test_the_processor_refuses_a_1x300_png_and_exif_raises() -> None:
    with pytest.raises(struct.error):  # the hostile input is real: Pillow itself raises on it
        from PIL import ImageOps

        ImageOps.exif_transpose(Image.open(io.BytesIO(bad_exif_jpeg())))
    assert decode(image(1, 300)).height == 300  # it decodes: only the processor refuses it


def test_a_bad_image_fails_its_request_alone_and_planning_goes_on(tmp_path: Path, vlm: VisionLoaded) -> None:
    folder = tmp_path / "img"
    folder.mkdir()
    for name in ("thin.png", "exif.jpg", "good.png"):
        (folder / name).write_bytes(image(64, 48))  # valid at submit; replaced after (the worker judges)
    access = ImageAccess.create([folder])
    lines = [
        line("text-1", None, "Name three colors."),
        line("thin", str(folder / "thin.png")),
        line("exif", str(folder / "exif.jpg")),
        line("good", str(folder / "good.png")),
        line("text-2", None, "Count to three."),
    ]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    store = Store(f"sqlite:///{tmp_path / 'jobs.db'}")
    job = load_job(store, tmp_path / "in.jsonl", "m", images=access).job_id
    (folder / "thin.png").write_bytes(image(1, 300))
    (folder / "exif.jpg").write_bytes(bad_exif_jpeg())
    vlm.access = access
    engine = Engine(vlm, EngineConfig(completion_batch_size=4, prefill_batch_size=4))

    outcome = run_shard(store, engine, job)
    rows = {r.custom_id: r for r in store.iter_requests(job)}
    assert {c: r.status for c, r in rows.items()} == {
        "text-1": RequestStatus.COMPLETED,
        "thin": RequestStatus.FAILED,
        "exif": RequestStatus.FAILED,
        "good": RequestStatus.COMPLETED,
        "text-2": RequestStatus.COMPLETED,
    }
    assert rows["thin"].error_code == "image_rejected_by_processor"
    assert "1x300" in rows["thin"].error_message and "aspect ratio" in rows["thin"].error_message
    assert rows["exif"].error_code == "invalid_image" and "EXIF" in rows["exif"].error_message
    assert (outcome.completed, outcome.failed) == (3, 2)
    assert store.get_job(job).status == lifecycle.COMPLETED

    again = run_shard(store, engine, job)  # what `run --resume` does: nothing is pending, nothing runs again
    assert (again.completed, again.failed) == (0, 0)
    assert {r.custom_id: r.error_code for r in store.iter_requests(job)} == {c: r.error_code for c, r in rows.items()}


def test_submit_refuses_what_the_processor_would(tmp_path: Path) -> None:
    folder = tmp_path / "img"
    folder.mkdir()
    (folder / "wide.jpg").write_bytes(image(402, 2, "JPEG"))
    (folder / "fine.webp").write_bytes(image(300, 2, "WEBP"))  # 150:1 is allowed
    uri = "data:image/png;base64," + base64.b64encode(image(1, 300)).decode()
    gif = "data:image/gif;base64," + base64.b64encode(image(250, 1, "GIF")).decode()
    lines = [line("a", uri), line("b", str(folder / "wide.jpg")), line("c", str(folder / "fine.webp")), line("d", gif)]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    store = Store(f"sqlite:///{tmp_path / 'jobs.db'}")
    result = load_job(store, tmp_path / "in.jsonl", "m", images=ImageAccess.create([folder]))
    assert result.rejected
    got = {e.line: (e.code, e.field) for e in result.errors}
    field = "body.messages[0].content[0].image_url.url"
    assert got == {n: ("image_rejected_by_processor", field) for n in (1, 2, 4)}
    assert "1x300" in result.errors[0].message and "crop or pad" in result.errors[0].message


def scan_bomb(scans: int) -> bytes:
    """A small progressive JPEG with one of its scans repeated `scans` times (a CPU bomb under the pixel limit)."""
    data = image(64, 64, "JPEG")
    buf = io.BytesIO()
    Image.open(io.BytesIO(data)).save(buf, "JPEG", progressive=True)
    data = buf.getvalue()
    last = data.rindex(b"\xff\xda")
    scan = data[last:-2]  # the last scan: its header and entropy-coded data, up to EOI
    return data[:-2] + scan * scans + b"\xff\xd9"


def test_a_progressive_jpeg_of_many_scans_is_refused_before_decoding() -> None:
    assert decode(scan_bomb(10)).width == 64  # a few scans more than usual decode as before
    bomb = scan_bomb(5000)
    assert len(bomb) < 100_000
    start = time.monotonic()
    with pytest.raises(ImageError) as err:
        decode(bomb)
    assert time.monotonic() - start < 0.5  # counted, not decoded
    assert err.value.code == "invalid_image" and "scans" in err.value.message


def test_an_image_is_decoded_once(vlm: VisionLoaded) -> None:
    uri = "data:image/png;base64," + base64.b64encode(image(56, 84, color=(1, 2, 3))).decode()
    vlm.memo = ImageMemo()
    prompt = vlm.prompt("/v1/chat/completions", json.loads(line("x", uri))["body"])
    (span,) = prompt.media
    assert span.image.pixels.size == (56, 84)  # what the encoder reads: the pixels decoded when loaded
    assert vlm.memo.pixels.decodes == 0
    vlm.memo.pixels = PixelCache(max_bytes=1)  # evicted: decoded again, once
    fresh = ImageRef(span.image.data, 56, 84, span.image.digest, cache=vlm.memo.pixels)
    assert fresh.pixels.size == (56, 84) and vlm.memo.pixels.decodes == 1


def test_remote_images_of_a_page_are_fetched_together(vlm: VisionLoaded) -> None:
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    body_png = image(56, 56, color=(9, 9, 9))
    state = {"now": 0, "most": 0}
    lock = threading.Lock()

    class Slow(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            with lock:
                state["now"] += 1
                state["most"] = max(state["most"], state["now"])
            time.sleep(0.4)
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(body_png)))
            self.end_headers()
            self.wfile.write(body_png)
            with lock:
                state["now"] -= 1

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Slow)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        vlm.access = ImageAccess.create(allow_remote=True, allow_remote_hosts=["127.0.0.1"])
        vlm.memo = ImageMemo()
        urls = [f"http://127.0.0.1:{server.server_port}/{i}.png" for i in range(4)]
        bodies = [json.loads(line(str(i), u))["body"] for i, u in enumerate(urls)]
        text = json.loads(line("t", None))["body"]
        vlm.want_images([("/v1/chat/completions", b) for b in [text, *bodies]])
        assert vlm.prompt("/v1/chat/completions", text).tokens  # a text row does not wait for the fetches
        prompts = [vlm.prompt("/v1/chat/completions", b) for b in bodies]
        assert all(p.media for p in prompts)
        assert state["most"] >= 2  # several fetched at once, not one after another
    finally:
        server.shutdown()
        vlm.access = ImageAccess()
        vlm.prefetch = None


def test_a_vision_tower_failure_fails_its_request_alone(
    tmp_path: Path, vlm: VisionLoaded, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The vision encoder raising on one image (after planning, at prefill) is contained to its request: it ends
    with engine_error after running alone; the text and the other image requests beside it complete."""
    assert vlm.vision is not None
    bad = image(56, 84, color=(7, 7, 7))
    real = vlm.vision.encode

    def encode(img: Any) -> Any:
        if img.width == 56 and img.height == 84:
            raise RuntimeError("the vision tower failed")
        return real(img)

    monkeypatch.setattr(vlm.vision, "encode", encode)
    vlm.vision.features.clear()
    vlm.access, vlm.memo = ImageAccess(), ImageMemo()
    uri = "data:image/png;base64," + base64.b64encode(bad).decode()
    good = "data:image/png;base64," + base64.b64encode(image(64, 48, color=(1, 250, 1))).decode()
    lines = [line("text", None, "Name a color."), line("bad", uri), line("good", good), line("text-2", None, "Hi.")]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    store = Store(f"sqlite:///{tmp_path / 'jobs.db'}")
    job = load_job(store, tmp_path / "in.jsonl", "m").job_id
    run_shard(store, Engine(vlm, EngineConfig(completion_batch_size=4, prefill_batch_size=4)), job)
    rows = {r.custom_id: r for r in store.iter_requests(job)}
    assert {c: r.status for c, r in rows.items()} == {
        "text": RequestStatus.COMPLETED,
        "bad": RequestStatus.FAILED,
        "good": RequestStatus.COMPLETED,
        "text-2": RequestStatus.COMPLETED,
    }
    assert rows["bad"].error_code == "engine_error" and "vision tower failed" in rows["bad"].error_message
