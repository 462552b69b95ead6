"""A prompt with images: token ids (each image expanded to its image tokens) and where each image sits.

Pure logic: no MLX. Image tokens count as prompt tokens. Every image token has the same id, so the ids alone
cannot tell two images apart; `key_units` gives the prefix key instead: the token ids up to each image's first
position, and from there on units derived from the image's digest (a hash of its decoded pixels and size). The
same image after the same text gives the same key, so its cache is reused; a different image never is.
(worker/prompts.py owns the key encoding; these units are what it encodes for an image span.)
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

IMAGE_UNIT_FLAG = 1 << 31  # image units are >= 2**31: never equal to a token id (vocabularies are far smaller)


@dataclass(frozen=True)
class ImageSpan:
    """One image in a prompt: its first token position, how many image tokens it has, and its identity."""

    start: int
    length: int
    digest: bytes

    @property
    def end(self) -> int:
        return self.start + self.length


@dataclass(frozen=True)
class VisionPrompt:
    """Token ids with image tokens in place, and the images' spans in order. `extra` is per-family model input."""

    tokens: tuple[int, ...]
    spans: tuple[ImageSpan, ...]
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        last = 0
        for span in self.spans:
            if span.start < last or span.length < 1 or span.end > len(self.tokens):
                raise ValueError(f"image spans must be ordered, non-empty and inside the prompt: {span}")
            last = span.end

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def first_image(self) -> int:
        """The first image position (len(tokens) without images): the key up to here is plain text."""
        return self.spans[0].start if self.spans else len(self.tokens)

    def key_units(self) -> list[int]:
        """One unsigned 32-bit unit per prompt position: token ids, and image units inside image spans."""
        units = list(self.tokens)
        for span in self.spans:
            units[span.start : span.end] = image_units(span.digest, span.length)
        return units


def image_units(digest: bytes, length: int) -> list[int]:
    """`length` units for one image: unit i is 31 bits of blake2b(digest, i), flagged as an image unit.

    Every position differs between two images, so two images never share a key from their first position on.
    """
    out = []
    for i in range(length):
        h = hashlib.blake2b(digest + i.to_bytes(4, "big"), digest_size=4).digest()
        out.append(IMAGE_UNIT_FLAG | (int.from_bytes(h, "big") & (IMAGE_UNIT_FLAG - 1)))
    return out


def expand_image_tokens(
    ids: list[int], image_token: int, counts: list[int], fills: list[list[int]] | None = None
) -> tuple[list[int], list[int]]:
    """Replace the k-th `image_token` in `ids` by counts[k] copies (or by fills[k], its counts[k] ids, where a
    family puts other tokens among them); return the ids and each image's start.

    The chat template puts one image token per image; the vision tower decides how many it becomes.
    """
    found = sum(1 for t in ids if t == image_token)
    if found != len(counts):
        raise ValueError(f"the chat template placed {found} image token(s) for {len(counts)} image(s)")
    for n, fill in zip(counts, fills or (), strict=False):
        if len(fill) != n:
            raise ValueError(f"an image of {n} positions needs {n} ids, got {len(fill)}")
    out: list[int] = []
    starts: list[int] = []
    k = 0
    for t in ids:
        if t == image_token:
            starts.append(len(out))
            out.extend(fills[k] if fills is not None else [image_token] * counts[k])
            k += 1
        else:
            out.append(t)
    return out, starts
