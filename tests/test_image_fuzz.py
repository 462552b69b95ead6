"""Mutated images through decode and prompt building (issue 21): valid PNG, JPEG (baseline, progressive, with
EXIF), GIF and WebP files, mutated with a fixed seed (byte flips, cuts, repeats, splices, header fields set to
extremes, PNG chunks re-checksummed so that mutations reach the decoder), each sent as one request's data: URI
image to the tiny Qwen2-VL's prompt builder. Every case either builds a prompt or fails with a PromptError
carrying one of the image codes: never a bare exception, which would fail the shard.

Bounded in time (FUZZ_SECONDS) and cases (FUZZ_CASES): a few thousand in CI. The number run is printed."""

from __future__ import annotations

import base64
import io
import random
import struct
import time
import zlib
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("mlx_vlm")

from PIL import Image

from omlx_jobs.errors import ErrorCode
from omlx_jobs.jobs.formats import CHAT_URL
from omlx_jobs.worker import loading
from omlx_jobs.worker.prompts import PromptError
from omlx_jobs.worker.vision.inputs.images import IMAGE_ERROR_CODES, ImageLimits
from omlx_jobs.worker.vision.inputs.media import ImageMemo
from omlx_jobs.worker.vision.loaded import VisionLoaded
from tests.tiny_vlm import build_tiny_vlm

SEED = 21
FUZZ_SECONDS = 15.0
FUZZ_CASES = 6000
MIN_CASES = 1500
ALLOWED = {ErrorCode(c) for c in IMAGE_ERROR_CODES} | {ErrorCode.IMAGE_REJECTED_BY_PROCESSOR}
MEDIA = {"PNG": "image/png", "JPEG": "image/jpeg", "GIF": "image/gif", "WEBP": "image/webp"}


def seeds() -> list[tuple[str, bytes]]:
    """The valid files mutated: small, of every format and the modes and metadata that take other code paths."""
    rgb = Image.new("RGB", (24, 20), (10, 120, 230))
    for x in range(24):
        rgb.putpixel((x, x % 20), (250, x * 10, 0))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate on load
    exif[0x010F] = "camera"
    exif[0x8769] = {0x9003: "2020:01:01 10:00:00", 0x829A: 0.01}  # an Exif IFD: nested offsets to mutate
    out = []
    for fmt, kw, img in [
        ("PNG", {}, rgb),
        ("PNG", {}, rgb.convert("P")),
        ("PNG", {}, rgb.convert("LA")),
        ("JPEG", {}, rgb),
        ("JPEG", {"progressive": True}, rgb),
        ("JPEG", {"exif": exif.tobytes()}, rgb),
        ("GIF", {}, rgb.convert("P")),
        ("GIF", {"save_all": True, "append_images": [rgb.rotate(90).convert("P")]}, rgb.convert("P")),
        ("WEBP", {"lossless": True}, rgb),
        ("WEBP", {"quality": 60, "exif": exif.tobytes()}, rgb),
    ]:
        buf = io.BytesIO()
        img.save(buf, fmt, **kw)
        out.append((fmt, buf.getvalue()))
    return out


def _flip(rng: random.Random, d: bytearray) -> None:
    for _ in range(rng.randint(1, 8)):
        d[rng.randrange(len(d))] = rng.randrange(256)


def _flip_head(rng: random.Random, d: bytearray) -> None:
    """Flip bytes among the first 160: headers and metadata (EXIF, IHDR, VP8X) live there."""
    for _ in range(rng.randint(1, 4)):
        d[rng.randrange(min(len(d), 160))] = rng.randrange(256)


def _extreme(rng: random.Random, d: bytearray) -> None:
    i = rng.randrange(max(1, len(d) - 4))
    d[i : i + rng.choice((1, 2, 4))] = rng.choice((b"\xff\xff\xff\xff", b"\x00\x00\x00\x00", b"\x7f\xff", b"\x80"))


def _cut(rng: random.Random, d: bytearray) -> None:
    del d[rng.randrange(1, len(d)) :]


def _delete(rng: random.Random, d: bytearray) -> None:
    i = rng.randrange(len(d))
    del d[i : i + rng.randint(1, 64)]


def _repeat(rng: random.Random, d: bytearray) -> None:
    i = rng.randrange(len(d))
    piece = d[i : i + rng.randint(1, 32)]
    d[i:i] = piece * rng.randint(1, 40)


def _splice(rng: random.Random, d: bytearray, other: bytes) -> None:
    i, j = rng.randrange(len(d)), rng.randrange(len(other))
    d[i:] = other[j:]


MUTATIONS: list[Callable[[random.Random, bytearray], None]] = [_flip, _flip_head, _extreme, _cut, _delete, _repeat]


def fix_png_crcs(d: bytes) -> bytes:
    """Recompute every chunk's CRC, so that the decoder reads the mutated chunk instead of refusing its checksum."""
    if not d.startswith(b"\x89PNG\r\n\x1a\n"):
        return d
    out, i = bytearray(d[:8]), 8
    while i + 8 <= len(d):
        (n,) = struct.unpack(">I", d[i : i + 4])
        body = d[i + 4 : i + 8 + n]
        if len(body) < 4 + n or n > len(d):
            out += d[i:]
            break
        out += d[i : i + 4] + body + struct.pack(">I", zlib.crc32(body))
        i += 12 + n
    return bytes(out)


def _flip_exif(rng: random.Random, d: bytearray) -> None:
    """Flip a few bytes of the EXIF block: its offsets, types and counts are what Pillow's parser trusts (and
    what exif_transpose writes back)."""
    at = d.find(b"Exif\x00\x00")
    if at < 0:
        return _flip(rng, d)
    size = struct.unpack(">H", d[at - 2 : at])[0] - 2 if d[at - 4 : at - 2] == b"\xff\xe1" else 100
    for _ in range(rng.randint(1, 4)):
        d[rng.randrange(at + 6, min(len(d), at + size))] = rng.randrange(256)


def mutate(rng: random.Random, fmt: str, data: bytes, pool: list[tuple[str, bytes]]) -> bytes:
    d = bytearray(data)
    if b"Exif\x00\x00" in data and rng.random() < 0.6:
        _flip_exif(rng, d)
        return bytes(d)
    for _ in range(rng.randint(1, 3)):
        if len(d) < 2:
            break
        if rng.random() < 0.1:
            _splice(rng, d, rng.choice(pool)[1])
        else:
            rng.choice(MUTATIONS)(rng, d)
    if fmt == "PNG" and rng.random() < 0.7:
        return fix_png_crcs(bytes(d))
    return bytes(d)


def body(fmt: str, data: bytes) -> dict:
    url = f"data:{MEDIA[fmt]};base64," + base64.b64encode(data).decode()
    parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is it?"}]
    return {"messages": [{"role": "user", "content": parts}], "max_tokens": 1}


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> VisionLoaded:
    out = loading.load(str(build_tiny_vlm(tmp_path_factory.mktemp("qwen2_vl"))))
    assert isinstance(out, VisionLoaded)
    out.limits = ImageLimits(max_pixels=2_000_000)  # a mutated header may claim more: keep each case fast
    return out


def test_mutated_images_fail_typed_and_alone(vlm: VisionLoaded, tmp_path: Path) -> None:
    rng = random.Random(SEED)
    pool = seeds()
    for fmt, data in pool:  # the seeds themselves are fine
        assert vlm.prompt(CHAT_URL, body(fmt, data)).media, fmt
    weighted = pool + [p for p in pool if b"Exif\x00\x00" in p[1]] * 4  # the EXIF parser is a rich target
    outcomes: Counter[str] = Counter()
    deadline, cases = time.monotonic() + FUZZ_SECONDS, 0
    while cases < FUZZ_CASES and time.monotonic() < deadline:
        fmt, data = rng.choice(weighted)
        mutated = mutate(rng, fmt, data, pool)
        vlm.memo = ImageMemo()  # judge every case afresh (the memo would answer a repeated URL)
        try:
            vlm.prompt(CHAT_URL, body(fmt, mutated))
            outcomes["ok"] += 1
        except PromptError as exc:
            assert exc.code in ALLOWED, (exc.code, exc.message, mutated.hex())
            assert exc.message, mutated.hex()
            outcomes[str(exc.code)] += 1
        except Exception as exc:  # the defect: a bare exception fails every request of the shard
            (tmp_path / "case.bin").write_bytes(mutated)
            raise AssertionError(f"case {cases} ({fmt}) raised {type(exc).__name__}: {exc}") from exc
        cases += 1
    print(f"\nimage fuzz: {cases} cases, seed {SEED}: {dict(outcomes)}")
    assert cases >= MIN_CASES, f"only {cases} cases in {FUZZ_SECONDS}s"
    assert outcomes["ok"] and outcomes["invalid_image"]  # both sides reached
