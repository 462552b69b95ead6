"""An image's size from its header bytes (PNG, GIF, JPEG, WebP), and the size limits vision processors share.

Pure logic: no Pillow, no MLX. Submit reads the first bytes of an image and judges what can be judged without
decoding it: an aspect ratio that Qwen2-VL's processor (and every smart_resize port in mlx-vlm) refuses. The
worker checks again with the decoded size (worker/vision/inputs/images.py decodes; the processor itself has the last
word there).
"""

from __future__ import annotations

import struct

MAX_ASPECT_RATIO = 200
"""Qwen2-VL's smart_resize refuses max(w, h) / min(w, h) > 200 ("absolute aspect ratio must be smaller than 200")."""
MAX_JPEG_SCANS = 100
"""Scans a JPEG may hold: each scan of a progressive JPEG re-walks the whole image, so thousands of tiny scans are
a CPU bomb under the pixel limit (libjpeg's progressive scripts use about 10)."""
HEAD_BYTES = 256 * 1024
"""Bytes of a file submit reads to find its size (a JPEG's frame header can follow a large EXIF block)."""

_SOF = frozenset({0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})


def image_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) from the header, or None where it is not in `data` or not readable (the decoder judges)."""
    try:
        if data.startswith(b"\x89PNG\r\n\x1a\n") and data[12:16] == b"IHDR":
            return struct.unpack(">II", data[16:24])
        if data[:6] in (b"GIF87a", b"GIF89a"):
            return struct.unpack("<HH", data[6:10])
        if data.startswith(b"\xff\xd8"):
            return _jpeg_size(data)
        if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
            return _webp_size(data)
    except struct.error:  # the header is cut short
        return None
    return None


def aspect_problem(size: tuple[int, int]) -> str | None:
    """Why a vision processor refuses an image of this size, or None."""
    width, height = size
    if width < 1 or height < 1:
        return f"it is {width}x{height} pixels: an image needs at least one pixel each way"
    ratio = max(width, height) / min(width, height)
    if ratio > MAX_ASPECT_RATIO:
        return (
            f"it is {width}x{height} pixels, an aspect ratio of {ratio:.0f}:1; vision processors (Qwen2-VL's) refuse "
            f"over {MAX_ASPECT_RATIO}:1: crop or pad it"
        )
    return None


def jpeg_scans(data: bytes) -> int:
    """How many scans a JPEG holds (0 for other formats). Entropy-coded data never holds FF DA (an FF there is
    stuffed with 00), so counting that marker counts the scans, without decoding."""
    return data.count(b"\xff\xda") if data.startswith(b"\xff\xd8") else 0


def scans_problem(data: bytes, limit: int = MAX_JPEG_SCANS) -> str | None:
    """Why a JPEG's scans are refused, or None."""
    scans = jpeg_scans(data)
    if scans > limit:
        return f"it is a JPEG of {scans:,} scans, over the limit of {limit} (a progressive one has ~10): re-encode it"
    return None


def _jpeg_size(data: bytes) -> tuple[int, int] | None:
    """The first frame header's size, walking the marker segments (no entropy-coded data comes before it)."""
    i = 2
    while i + 4 <= len(data):
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker in (0x01, *range(0xD0, 0xD8)):  # standalone markers
            i += 2
            continue
        (length,) = struct.unpack(">H", data[i + 2 : i + 4])
        if marker in _SOF:
            height, width = struct.unpack(">HH", data[i + 5 : i + 9])
            return width, height
        if marker == 0xDA or length < 2:  # scan data before any frame header: not a JPEG we can size
            return None
        i += 2 + length
    return None


def _webp_size(data: bytes) -> tuple[int, int] | None:
    kind = data[12:16]
    if kind == b"VP8X":
        w = int.from_bytes(data[24:27], "little") + 1
        h = int.from_bytes(data[27:30], "little") + 1
        return (w, h) if len(data) >= 30 else None
    if kind == b"VP8L" and data[20:21] == b"\x2f":
        (bits,) = struct.unpack("<I", data[21:25])
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    if kind == b"VP8 " and data[23:26] == b"\x9d\x01\x2a":
        w, h = struct.unpack("<HH", data[26:30])
        return w & 0x3FFF, h & 0x3FFF
    return None
