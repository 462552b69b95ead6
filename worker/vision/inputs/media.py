"""A request's images in the engine: checked and decoded once, kept as their encoded bytes, placed in its prompt.

ImageRef is a request's image (size and digest known, pixels kept in a bounded PixelCache for the encoder), ImageMemo
the images loaded lately by URL (a job asks many questions about one image), ImageMedia an image span of an engine
Prompt, and `vision_prompt` the vision prefill's view of such a prompt.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from omlx_jobs.errors import ErrorCode
from omlx_jobs.jobs.images import ImageAccess
from omlx_jobs.worker.prompts import ImageError, MediaSpan, Prompt
from omlx_jobs.worker.vision.inputs.images import DEFAULT_LIMITS, DecodedImage, ImageLimits, decode, fetch
from omlx_jobs.worker.vision.prompt import ImageSpan, VisionPrompt

Fetcher = Callable[[str, ImageAccess], bytes]
"""Where an image's bytes come from (images.fetch, or a prefetch started ahead: prefetch.py)."""


class PixelCache:
    """Decoded pixels by digest, bounded in bytes: the encoder takes the pixels its ImageRef decoded when loaded,
    so an image is decoded once, not once to be checked and again to be encoded. Evicted pixels decode again."""

    def __init__(self, max_bytes: int = 512 * 1024**2) -> None:
        self.max_bytes = max_bytes
        self._items: OrderedDict[bytes, Any] = OrderedDict()
        self._bytes = 0
        self.decodes = 0
        """Decodes made because the pixels were not here (a test counts them)."""

    def put(self, digest: bytes, pixels: Any) -> None:
        if digest in self._items:
            self._items.move_to_end(digest)
            return
        self._items[digest] = pixels
        self._bytes += _pixel_bytes(pixels)
        while len(self._items) > 1 and self._bytes > self.max_bytes:
            _, gone = self._items.popitem(last=False)
            self._bytes -= _pixel_bytes(gone)

    def get(self, digest: bytes) -> Any | None:
        pixels = self._items.get(digest)
        if pixels is not None:
            self._items.move_to_end(digest)
        return pixels


def _pixel_bytes(pixels: Any) -> int:
    return int(pixels.width) * int(pixels.height) * 3


@dataclass(frozen=True)
class ImageRef:
    """A request's image, checked and decoded once (size, digest); its encoded bytes are kept, and its pixels in
    the shared PixelCache while they fit, so that a shard of thousands of image requests stays small. `pixels`
    decodes again only when the cache has let them go."""

    data: bytes = field(repr=False)
    width: int
    height: int
    digest: bytes
    limits: ImageLimits = DEFAULT_LIMITS
    cache: PixelCache | None = field(default=None, repr=False, compare=False)

    @classmethod
    def load(
        cls,
        url: str,
        access: ImageAccess,
        limits: ImageLimits = DEFAULT_LIMITS,
        cache: PixelCache | None = None,
        fetcher: Fetcher = fetch,
    ) -> ImageRef:
        data = fetcher(url, access)
        image = decode(data, limits)
        if cache is not None:
            cache.put(image.digest, image.pixels)
        return cls(data, image.width, image.height, image.digest, limits, cache)

    @property
    def pixels(self) -> Any:
        if self.cache is not None:
            kept = self.cache.get(self.digest)
            if kept is not None:
                return kept
            self.cache.decodes += 1
        image = decode(self.data, self.limits)
        if image.digest != self.digest:  # the bytes are ours, in memory: this never happens
            raise ImageError(ErrorCode.INVALID_IMAGE, "the image decoded differently the second time")
        if self.cache is not None:
            self.cache.put(self.digest, image.pixels)
        return image.pixels

    def decoded(self) -> DecodedImage:
        return DecodedImage(self.pixels, self.width, self.height, self.digest)


class ImageMemo:
    """Images loaded lately, by URL (data: URIs and http(s); files are read again each time): a job asks many
    questions about one image, and it is decoded, fetched or found unreachable once, not once per question.
    Bounded in bytes and entries; a failure is kept as its code and message only."""

    def __init__(self, max_bytes: int = 256 * 1024**2, max_entries: int = 4096, ttl: float = 60.0) -> None:
        self.max_bytes, self.max_entries, self.ttl = max_bytes, max_entries, ttl
        self.pixels = PixelCache()
        self._items: OrderedDict[bytes, tuple[float, ImageRef | tuple[str, str]]] = OrderedDict()
        self._bytes = 0

    def load(self, url: str, access: ImageAccess, limits: ImageLimits, fetcher: Fetcher = fetch) -> ImageRef:
        if not url.startswith(("data:", "http://", "https://")):
            return ImageRef.load(url, access, limits, self.pixels)
        key, now = hashlib.sha256(url.encode("utf-8", "surrogatepass")).digest(), time.monotonic()
        hit = self._items.get(key)
        if hit is None or now - hit[0] >= self.ttl:
            value: ImageRef | tuple[str, str]
            try:
                value = ImageRef.load(url, access, limits, self.pixels, fetcher)
            except ImageError as exc:
                value = (str(exc.code), exc.message)
            self._put(key, now, value)
        else:
            self._items.move_to_end(key)
            value = hit[1]
        if isinstance(value, tuple):
            raise ImageError(*value)
        return value

    def has(self, url: str) -> bool:
        """Whether `url` was loaded lately (a prefetch would be wasted on it)."""
        hit = self._items.get(hashlib.sha256(url.encode("utf-8", "surrogatepass")).digest())
        return hit is not None and time.monotonic() - hit[0] < self.ttl

    def _put(self, key: bytes, now: float, value: ImageRef | tuple[str, str]) -> None:
        old = self._items.pop(key, None)
        self._bytes -= _size(old[1]) if old is not None else 0
        self._items[key] = (now, value)
        self._bytes += _size(value)
        while len(self._items) > 1 and (self._bytes > self.max_bytes or len(self._items) > self.max_entries):
            _, (_, gone) = self._items.popitem(last=False)
            self._bytes -= _size(gone)


def _size(value: ImageRef | tuple[str, str]) -> int:
    return len(value.data) if isinstance(value, ImageRef) else 0


@dataclass(frozen=True)
class ImageMedia(MediaSpan):
    """An image span of a prompt, with the image itself (for the vision encoder)."""

    image: ImageRef = field(compare=False, repr=False)


def vision_prompt(prompt: Prompt) -> VisionPrompt:
    """The vision prefill's view of an engine prompt: its tokens, image spans and images."""
    media = [m for m in prompt.media if isinstance(m, ImageMedia)]
    spans = tuple(ImageSpan(m.start, m.length, m.digest) for m in media)
    return VisionPrompt(tuple(prompt.tokens), spans, {"images": tuple(_Lazy(m.image) for m in media)})


class _Lazy:
    """An ImageRef as the vision model reads a DecodedImage: size and digest at once, pixels when encoded."""

    def __init__(self, ref: ImageRef) -> None:
        self.ref, self.width, self.height, self.digest = ref, ref.width, ref.height, ref.digest

    @property
    def pixels(self) -> Any:
        return self.ref.pixels


def media_end(prompt: Prompt) -> int:
    """The position just after the prompt's last image (0 without images)."""
    return max((m.start + m.length for m in prompt.media), default=0)


def has_media(prompt: Prompt | None, start: int, end: int) -> bool:
    """Whether positions [start, end) of the prompt hold any image position."""
    return prompt is not None and any(m.start < end and m.start + m.length > start for m in prompt.media)
