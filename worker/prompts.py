"""Prompts and their prefix keys: the only code that knows how a key is encoded; and the errors of a prompt that
cannot run (PromptError, ImageError). Pure: no MLX.

A key holds one fixed-width, big-endian value per prompt position, so byte order is position order: sorting,
comparing and common-prefix search of keys run in C over bytes, and the planner's trie, the prefix cache and
the disk tier never look inside a value. A text position holds its token id.

Images (next): an image's positions hold values derived from a hash of its decoded pixels and the position's
index within the image (`media_values`), with the top bit set so that they never equal a token id. From an
image's first position on, the key then says which image it is: the same image after the same text shares a
cache entry, and a different image does not. With 4-byte positions two different images agree on a position
with probability 2^-31; for jobs of millions of images after the same text that is too likely, so images should
come with POSITION_BYTES = 8 (and the disk tier's folder should then name the width, so that files written with
one width are never read with the other).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

from omlx_jobs.errors import ErrorCode, OmlxError

POSITION_BYTES = 4
_FORMAT = {4: "I", 8: "Q"}[POSITION_BYTES]
_MEDIA_BIT = 1 << (8 * POSITION_BYTES - 1)


def token_key(tokens: Sequence[int]) -> bytes:
    """The key of a text prompt: byte-wise order equals token-wise lexicographic order."""
    return struct.pack(f">{len(tokens)}{_FORMAT}", *tokens)


def key_tokens(key: bytes) -> list[int]:
    """The values of a key, one per position (the token ids of a text prompt)."""
    return list(struct.unpack(f">{positions(key)}{_FORMAT}", key))


def positions(key: bytes) -> int:
    """Prompt positions a key covers."""
    return len(key) // POSITION_BYTES


def key_prefix(key: bytes, n: int) -> bytes:
    """The key of the first `n` positions."""
    return key[: n * POSITION_BYTES]


def common_prefix(a: bytes, b: bytes) -> int:
    """Positions two keys share from the start (binary search over C-level slice compares)."""
    width = POSITION_BYTES
    hi = min(len(a), len(b)) // width
    if a[: hi * width] == b[: hi * width]:
        return hi
    lo = 0  # a[:lo] == b[:lo] holds; a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[: mid * width] == b[: mid * width]:
            lo = mid
        else:
            hi = mid
    return lo


def media_values(digest: bytes, count: int) -> list[int]:
    """Key values of an image's `count` positions: each depends on the whole pixel hash `digest` and its index."""
    width = POSITION_BYTES
    out = []
    for i in range(count):
        h = hashlib.blake2b(digest, digest_size=width, person=b"omlx-img", salt=i.to_bytes(16, "big")).digest()
        out.append(_MEDIA_BIT | (int.from_bytes(h, "big") & (_MEDIA_BIT - 1)))
    return out


@dataclass(frozen=True)
class MediaSpan:
    """Positions [start, start + length) of a prompt hold one image, identified by `digest` (its pixel hash)."""

    start: int
    length: int
    digest: bytes


@dataclass(frozen=True, eq=False)
class Prompt:
    """What the model reads: token ids (an image's positions hold its placeholder ids), its media, and its key."""

    tokens: list[int]
    key: bytes
    media: tuple[MediaSpan, ...] = field(default=())

    @classmethod
    def from_tokens(cls, tokens: Sequence[int]) -> Prompt:
        """A text prompt."""
        return cls(list(tokens), token_key(tokens))

    @classmethod
    def with_media(cls, tokens: Sequence[int], media: Sequence[MediaSpan]) -> Prompt:
        """A prompt whose image positions are keyed by their image (see media_values)."""
        values = list(tokens)
        for span in media:
            values[span.start : span.start + span.length] = media_values(span.digest, span.length)
        return cls(list(tokens), token_key(values), tuple(media))

    def __len__(self) -> int:
        return len(self.tokens)

    def prefix_key(self, n: int) -> bytes:
        """The key of the first `n` positions."""
        return key_prefix(self.key, n)


class PromptError(OmlxError):
    """A request that cannot run on this model; `code` is stored as the request's error code."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = ErrorCode(code)
        self.message = message


class ImageError(PromptError):
    """A request whose image cannot be used (vision/inputs/images.IMAGE_ERROR_CODES); the message says what to do."""
