"""Images for the worker: fetch the bytes (re-checking where they may come from), decode them with our limits.

mlx-vlm's own loader fetches any URL and opens any path, so it never sees a request's string: the worker reads
the bytes here (data: URI, a confined file, or an http(s) URL when remote images are on), decodes them with
Pillow under a byte and a pixel limit (a decompression bomb is an error, not a hang), applies the EXIF
orientation, converts to RGB, and names the image by a hash of its decoded pixels and size.

Every failure is an ImageError: a typed, per-request error (the request fails alone; the job goes on).
Pillow is imported on first decode, so a text-only worker never needs it.
"""

from __future__ import annotations

import hashlib
import io
import warnings
from dataclasses import dataclass, field
from typing import Any

from omlx_jobs.errors import IMAGE_SOURCE_CODES, ErrorCode
from omlx_jobs.jobs import fetch as remote
from omlx_jobs.jobs import image_size
from omlx_jobs.jobs import images as sources
from omlx_jobs.jobs.images import ImageAccess, ImageSourceError
from omlx_jobs.worker.prompts import ImageError

DEFAULT_MAX_PIXELS = 40_000_000  # a 12 MP photo is 12M; 40M decoded RGB is 120 MB
DEFAULT_MAX_JPEG_SCANS = image_size.MAX_JPEG_SCANS

# Codes a request's image can fail with in the worker (submit-time codes included: the worker checks again).
IMAGE_ERROR_CODES = IMAGE_SOURCE_CODES | {
    ErrorCode.TRUNCATED_IMAGE,
    ErrorCode.IMAGE_TOO_MANY_PIXELS,
    ErrorCode.IMAGE_UNREACHABLE,
    ErrorCode.IMAGES_NOT_SUPPORTED,
}


@dataclass(frozen=True)
class ImageLimits:
    """How much one image may cost: encoded bytes (from ImageAccess) and decoded pixels."""

    max_pixels: int = DEFAULT_MAX_PIXELS
    max_jpeg_scans: int = DEFAULT_MAX_JPEG_SCANS


DEFAULT_LIMITS = ImageLimits()


@dataclass(frozen=True)
class DecodedImage:
    """An RGB image with EXIF orientation applied; `digest` identifies its pixels and size."""

    pixels: Any = field(repr=False, compare=False)  # a PIL.Image.Image in mode RGB
    width: int
    height: int
    digest: bytes

    @property
    def hex(self) -> str:
        return self.digest.hex()


def load_image(url: str, access: ImageAccess, limits: ImageLimits = ImageLimits()) -> DecodedImage:
    """Fetch and decode one image_url, checked again against this worker's `access`."""
    return decode(fetch(url, access), limits, what=_what(url))


def fetch(url: str, access: ImageAccess) -> bytes:
    """The encoded bytes behind an image URL; never reads outside the allowed folders, never connects unless allowed."""
    try:
        source = sources.classify(url, access)
        if isinstance(source, sources.DataImage):
            return source.data
        if isinstance(source, sources.FileImage):
            return sources.read_confined(source, access)
        return remote.fetch_remote(source.url, access)  # checked addresses, one deadline per image
    except ImageSourceError as exc:
        raise ImageError(exc.code, exc.message) from None


def decode(data: bytes, limits: ImageLimits = ImageLimits(), *, what: str = "the image") -> DecodedImage:
    """Decode PNG, JPEG, WebP or GIF (the first frame) to RGB, within the pixel and scan limits, EXIF orientation
    applied. Every failure is an ImageError: whatever Pillow raises on a hostile file fails this image alone."""
    try:
        sources.check_format(data, what)
        check_scans(data, limits, what)
        return _decode(data, limits, what)
    except ImageError:
        raise
    except ImageSourceError as exc:
        raise ImageError(exc.code, exc.message) from None
    except Exception as exc:  # a hostile file reaches code paths Pillow does not guard (struct.error, TypeError)
        raise _broken(what, exc) from None


def check_scans(data: bytes, limits: ImageLimits, what: str) -> None:
    """Refuse a JPEG of more scans than `limits.max_jpeg_scans`, counted from its markers before any decode
    (jobs/image_size.py: a tiny scan repeated thousands of times is a CPU bomb under the pixel limit)."""
    problem = image_size.scans_problem(data, limits.max_jpeg_scans)
    if problem is not None:
        raise ImageError(ErrorCode.INVALID_IMAGE, f"{what}: {problem}")


def _decode(data: bytes, limits: ImageLimits, what: str) -> DecodedImage:
    from PIL import Image, ImageOps  # Pillow is optional (the [vision] extra)

    try:
        with warnings.catch_warnings():  # we check the size ourselves, below
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data), formats=sorted(set(sources.MEDIA_TYPES.values())))
    except Image.DecompressionBombError:
        raise _too_many_pixels(what, None, limits) from None
    width, height = img.size
    if width * height > limits.max_pixels:  # checked from the header, before any pixel is decoded
        raise _too_many_pixels(what, (width, height), limits)
    try:
        img.load()
    except Image.DecompressionBombError:
        raise _too_many_pixels(what, (width, height), limits) from None
    try:
        with warnings.catch_warnings():  # Pillow warns of each corrupt tag it skips: the error below says enough
            warnings.simplefilter("ignore", UserWarning)
            img = ImageOps.exif_transpose(img)
    except Exception as exc:  # a malformed EXIF block: struct.error, TypeError, KeyError, ...
        raise ImageError(
            ErrorCode.INVALID_IMAGE,
            f"{what} has a malformed EXIF block ({_kind(exc)}: {_clip(str(exc))}); strip its metadata "
            "(re-save it without EXIF) and send it again",
        ) from None
    if img.mode != "RGB":
        img = img.convert("RGB")
    return DecodedImage(img, img.width, img.height, pixel_digest(img))


def pixel_digest(img: Any) -> bytes:
    """SHA-256 of an RGB image's size and pixels: the same picture in any file format gets the same name."""
    h = hashlib.sha256(f"RGB:{img.width}x{img.height}:".encode())
    h.update(img.tobytes())
    return h.digest()


def _too_many_pixels(what: str, size: tuple[int, int] | None, limits: ImageLimits) -> ImageError:
    shown = f"{size[0]}x{size[1]} pixels" if size else "far too many pixels"
    return ImageError(
        ErrorCode.IMAGE_TOO_MANY_PIXELS,
        f"{what} is {shown}, over the limit of {limits.max_pixels:,}; resize it (a few megapixels is plenty)",
    )


def _broken(what: str, exc: BaseException) -> ImageError:
    text = str(exc)
    if "truncated" in text.lower() or isinstance(exc, EOFError):
        return ImageError(ErrorCode.TRUNCATED_IMAGE, f"{what} is truncated (the file ends early); send the whole file")
    shown = f"{_kind(exc)}: {_clip(text)}" if text else _kind(exc)
    message = f"{what} cannot be decoded ({shown}); send a valid PNG, JPEG, WebP or GIF"
    return ImageError(ErrorCode.INVALID_IMAGE, message)


def _kind(exc: BaseException) -> str:
    """The exception's name as Python shows it (struct.error, not error)."""
    module = type(exc).__module__
    return type(exc).__qualname__ if module == "builtins" else f"{module}.{type(exc).__qualname__}"


def _clip(text: str) -> str:
    return text if len(text) <= 200 else text[:197] + "..."


def _what(url: str) -> str:
    if url.startswith("data:"):
        return "the data: URI image"
    return url if len(url) <= 80 else url[:77] + "..."
