"""Pure pieces of the vision path, on plain data: image prompts and their key units, the feature cache."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass

import pytest

from omlx_jobs.worker.vision.feature_cache import FeatureCache
from omlx_jobs.worker.vision.prompt import (
    IMAGE_UNIT_FLAG,
    ImageSpan,
    VisionPrompt,
    expand_image_tokens,
    image_units,
)

IMG = 99


def test_expand_image_tokens() -> None:
    ids, starts = expand_image_tokens([1, 2, IMG, 3, IMG, 4], IMG, [3, 2])
    assert ids == [1, 2, IMG, IMG, IMG, 3, IMG, IMG, 4]
    assert starts == [2, 6]
    with pytest.raises(ValueError, match="placed 2 image token"):
        expand_image_tokens([IMG, IMG], IMG, [1])


def test_expand_image_tokens_with_other_ids_among_them() -> None:
    """Pixtral: each image's positions hold rows of image tokens with a break and an end token among them."""
    BRK, END = 97, 98
    ids, starts = expand_image_tokens([1, IMG, 2, IMG], IMG, [3, 5], [[IMG, IMG, END], [IMG, BRK, IMG, BRK, END]])
    assert ids == [1, IMG, IMG, END, 2, IMG, BRK, IMG, BRK, END]
    assert starts == [1, 5]
    with pytest.raises(ValueError, match="3 ids"):
        expand_image_tokens([IMG], IMG, [3], [[IMG, END]])


def test_spans_are_checked() -> None:
    with pytest.raises(ValueError):
        VisionPrompt((1, 2, 3), (ImageSpan(2, 2, b"x"),))  # past the end
    with pytest.raises(ValueError):
        VisionPrompt((1,) * 6, (ImageSpan(2, 2, b"x"), ImageSpan(3, 1, b"y")))  # overlapping


def test_key_units_differ_from_an_images_first_position_on() -> None:
    tokens = (5, 6, IMG, IMG, IMG, 7)
    a = VisionPrompt(tokens, (ImageSpan(2, 3, b"a" * 32),))
    b = VisionPrompt(tokens, (ImageSpan(2, 3, b"b" * 32),))
    ka, kb = a.key_units(), b.key_units()
    assert ka[:2] == kb[:2] == [5, 6]
    assert all(x != y for x, y in zip(ka[2:5], kb[2:5], strict=True))
    assert ka[5] == kb[5] == 7  # text after the image: same ids, but the key already differs before it
    assert ka == VisionPrompt(tokens, (ImageSpan(2, 3, b"a" * 32),)).key_units()
    assert a.first_image == 2 and VisionPrompt((1, 2), ()).first_image == 2


def test_image_units_never_equal_a_token_id() -> None:
    units = image_units(b"\0" * 32, 1000)
    assert all(IMAGE_UNIT_FLAG <= u < 1 << 32 for u in units)
    assert len(set(units)) > 990


@dataclass
class Blob:
    nbytes: int


def test_feature_cache_lru_in_bytes() -> None:
    cache: FeatureCache[Blob] = FeatureCache(max_bytes=100)
    calls: list[bytes] = []

    def get(key: bytes, size: int) -> Blob:
        return cache.get_or_compute(key, lambda: calls.append(key) or Blob(size))  # type: ignore[func-returns-value]

    get(b"a", 40)
    get(b"b", 40)
    get(b"a", 40)  # hit; a is now the most recent
    get(b"c", 40)  # evicts b
    assert calls == [b"a", b"b", b"c"]
    assert b"b" not in cache and b"a" in cache and cache.nbytes == 80
    get(b"huge", 500)  # computed, not kept, nothing evicted for it
    assert b"huge" not in cache and len(cache) == 2
    assert cache.snapshot() == {"hits": 1, "misses": 4, "evictions": 1, "encoder_calls": 4, "entries": 2, "bytes": 80}
    cache.clear()
    assert len(cache) == 0 and cache.nbytes == 0


def test_pure_modules_import_no_mlx() -> None:
    code = (
        "import sys; import omlx_jobs.worker.vision.prompt, omlx_jobs.worker.vision.feature_cache, "
        "omlx_jobs.jobs.images, omlx_jobs.jobs.parts; "
        "assert 'mlx' not in sys.modules and 'PIL' not in sys.modules, sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
