"""Vision models in the engine: load one, build image prompts, and compute image positions from embeddings.

The engine runs a vision model's requests as it runs text (worker/engine.py): one scheduler, one prefix
cache, one BatchGenerator decoding image and text rows together through mlx-lm's text model for the family
(VisionModel.decode_model). Token ids cannot carry an image, so every position of an image is computed here,
from the vision features, before a row goes in:
- warm-ups of shared prefixes that hold images (one system prompt and one image, many questions) run through
  VisionBackend.prefill, which the warm-ups call with the prompts their suffixes come from;
- at admission, VisionBackend.media_prefix extends the request's best cached prefix through its last image
  and hands that prefix to the row (through the prefix cache), so the batch only ever prefills text.
Caches carry their RoPE breaks (vision_prefill.PositionedKVCache), so a row's text runs at its true mRoPE
positions, whatever prefix it starts from. Families outside vision.BATCHED run on vision_serial.py instead.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from omlx_jobs.jobs.formats import CHAT_URL
from omlx_jobs.jobs.images import ImageAccess
from omlx_jobs.worker.backend.model import ModelBackend
from omlx_jobs.worker.cache import kv
from omlx_jobs.worker.cache.prefix_cache import Entry, Match, PrefixCache
from omlx_jobs.worker.models.loaded import LoadedModel
from omlx_jobs.worker.prompts import MediaSpan, Prompt
from omlx_jobs.worker.vision.images import (
    DEFAULT_LIMITS,
    DecodedImage,
    ImageError,
    ImageLimits,
    decode,
    fetch,
    image_urls,
)
from omlx_jobs.worker.vision.model import VisionModel
from omlx_jobs.worker.vision.prompt import ImageSpan, VisionPrompt

Caches = list[Any]


@dataclass(frozen=True)
class ImageRef:
    """A request's image, checked and decoded once (size, digest); its encoded bytes are kept, not its pixels,
    so that a shard of thousands of image requests stays small. `pixels` decodes again when the encoder runs."""

    data: bytes = field(repr=False)
    width: int
    height: int
    digest: bytes
    limits: ImageLimits = DEFAULT_LIMITS

    @classmethod
    def load(cls, url: str, access: ImageAccess, limits: ImageLimits = DEFAULT_LIMITS) -> ImageRef:
        data = fetch(url, access)
        image = decode(data, limits)
        return cls(data, image.width, image.height, image.digest, limits)

    @property
    def pixels(self) -> Any:
        image = decode(self.data, self.limits)
        if image.digest != self.digest:  # the bytes are ours, in memory: this never happens
            raise ImageError("invalid_image", "the image decoded differently the second time")
        return image.pixels

    def decoded(self) -> DecodedImage:
        return DecodedImage(self.pixels, self.width, self.height, self.digest)


class ImageMemo:
    """Images loaded lately, by URL (data: URIs and http(s); files are read again each time): a job asks many
    questions about one image, and it is decoded, fetched or found unreachable once, not once per question.
    Bounded in bytes and entries; a failure is kept as its code and message only."""

    def __init__(self, max_bytes: int = 256 * 1024**2, max_entries: int = 4096, ttl: float = 60.0) -> None:
        self.max_bytes, self.max_entries, self.ttl = max_bytes, max_entries, ttl
        self._items: OrderedDict[bytes, tuple[float, ImageRef | tuple[str, str]]] = OrderedDict()
        self._bytes = 0

    def load(self, url: str, access: ImageAccess, limits: ImageLimits) -> ImageRef:
        if not url.startswith(("data:", "http://", "https://")):
            return ImageRef.load(url, access, limits)
        key, now = hashlib.sha256(url.encode("utf-8", "surrogatepass")).digest(), time.monotonic()
        hit = self._items.get(key)
        if hit is None or now - hit[0] >= self.ttl:
            value: ImageRef | tuple[str, str]
            try:
                value = ImageRef.load(url, access, limits)
            except ImageError as exc:
                value = (str(exc.code), exc.message)
            self._put(key, now, value)
        else:
            self._items.move_to_end(key)
            value = hit[1]
        if isinstance(value, tuple):
            raise ImageError(*value)
        return value

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


@dataclass(frozen=True, eq=False)
class TemplatePrompt(Prompt):
    """A prompt for the serial fallback: the chat template's text and the images, for mlx-vlm's processor to
    expand (other families place image tokens their own way). `tokens` hold one image token per image, so
    the true prompt length is known only once the processor has run (vision_serial.py reports it)."""

    text: str = ""
    images: tuple[ImageRef, ...] = ()

    @classmethod
    def build(cls, vm: VisionModel, messages: list[dict[str, Any]], refs: list[ImageRef]) -> TemplatePrompt:
        from omlx_jobs.worker.vision.model import template_text

        text = template_text(vm, messages)
        tokens = list(vm.tokenizer(text)["input_ids"])
        return cls(tokens, Prompt.from_tokens(tokens).key, (), text, tuple(refs))


@dataclass
class VisionLoaded(LoadedModel):
    """A vision model loaded for the engine: `model` is the decode model, `vision` the mlx-vlm model."""

    vision: VisionModel | None = None
    access: ImageAccess = field(default_factory=ImageAccess)
    """Where this worker reads images from (--allow-files-from, --allow-remote-images), checked per request."""
    limits: ImageLimits = DEFAULT_LIMITS
    memo: ImageMemo = field(default_factory=ImageMemo, repr=False)

    def prompt(self, endpoint: str, body: dict[str, Any]) -> Prompt:
        """A chat request's prompt through the processor's template, each image fetched, decoded and placed."""
        if endpoint != CHAT_URL:  # a completions prompt: text, tokenized as for any model
            return Prompt.from_tokens(LoadedModel.encode(self, endpoint, body))
        vm = self.vision
        assert vm is not None
        messages = body["messages"]
        refs = [self.memo.load(url, self.access, self.limits) for _, _, url in image_urls(messages)]
        if not vm.batched:
            return TemplatePrompt.build(vm, messages, refs)
        built = vm.build_prompt(messages, refs)  # type: ignore[arg-type]  (an ImageRef has their size)
        media = [ImageMedia(s.start, s.length, s.digest, ref) for s, ref in zip(built.spans, refs, strict=True)]
        return Prompt.with_media(built.tokens, media)

    def encode(self, endpoint: str, body: dict[str, Any]) -> list[int]:
        return list(self.prompt(endpoint, body).tokens)

    def backend(self, **kw: Any) -> ModelBackend:
        assert self.vision is not None
        return VisionBackend(self.vision, self.model, **kw)


def load_vision(
    ref: str, path: Any, *, context_length: int | None = None, images: ImageAccess | None = None
) -> LoadedModel:
    """Load a vision model with mlx-vlm: the decode model shares its language weights (no copy)."""
    from omlx_jobs.worker.models.loaded import ModelLoadError

    try:
        vm = VisionModel.load(path)
    except Exception as exc:
        raise ModelLoadError(f"mlx-vlm could not load {path}: {exc}") from exc
    return loaded_vision(vm, ref, context_length=context_length, images=images)


def loaded_vision(
    vm: VisionModel, ref: str, *, context_length: int | None = None, images: ImageAccess | None = None
) -> VisionLoaded:
    """The engine's model for a loaded (or built in memory) VisionModel, reading images as `images` allows."""
    from mlx_lm.utils import load_tokenizer

    from omlx_jobs.worker.models.loaded import context_length_of, model_identity

    eos = vm.config.get("eos_token_id")
    tokenizer = load_tokenizer(vm.path, eos_token_ids=[eos] if isinstance(eos, int) else eos)
    return VisionLoaded(
        ref=ref,
        path=vm.path,
        model=vm.decode_model() if vm.batched else vm.model,
        tokenizer=tokenizer,
        config=vm.config,
        identity=model_identity(vm.path),
        context_length=context_length or context_length_of(vm.config, vm.path),
        vision=vm,
        access=images or ImageAccess(),
    )


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


class VisionBackend(ModelBackend):
    """The text backend, plus image positions computed from embeddings through mlx-vlm's language model."""

    def __init__(self, vm: VisionModel, model: Any, **kw: Any) -> None:
        super().__init__(model, **kw)
        self.vm = vm
        self._ready: dict[int, tuple[Match, int]] = {}
        """Image prefixes computed for a window's admissions, by admission position (and tokens computed)."""

    def before_admit(self, admissions: Sequence[Any], cache: PrefixCache, *, keep: bool) -> None:
        """Compute the image prefixes of a window's admissions together (media_prefix hands them out): one
        batched pass instead of one per request. With `keep`, a prefix already cached is held for its row, and
        requests of the window with the same images after the same text share one computation."""
        self._ready = {}
        todo: dict[Any, tuple[list[int], Prompt, Match | None, int]] = {}
        for a in admissions:
            prompt, position = a.work.prompt, a.position
            if not prompt.media:
                continue
            end = media_end(prompt)
            key = prompt.prefix_key(end) if keep else position
            if key in todo:
                todo[key][0].append(position)
                continue
            match = cache.lookup(prompt.key, limit=end, count=False) if keep else None
            if match is not None and match.length >= end:
                cache.hold(match.entry, position)  # until its row has taken it
                continue
            todo[key] = ([position], prompt, match, end)
        if not todo:
            return
        items = list(todo.values())
        starts = [m.length if m is not None else 0 for _, _, m, _ in items]
        bases = [kv.extendable(m.entry.value, m.entry.tokens, m.length) if m else None for _, _, m, _ in items]
        suffixes = [p.tokens[s:end] for (_, p, _, end), s in zip(items, starts, strict=True)]
        done = self.prefill(bases, suffixes, [set() for _ in items], [p for _, p, _, _ in items])
        for (positions, prompt, _, end), start, (caches, _) in zip(items, starts, done, strict=True):
            key, size = prompt.prefix_key(end), kv.nbytes(caches)
            if keep:
                entry = cache.add(key, caches, size, needed_until=max(positions), pin=True)
            else:
                entry = Entry(key, caches, size)
            for k, position in enumerate(positions):  # the first computed it; the others reuse it
                self._ready[position] = (Match(entry, end), end - start if k == 0 else 0)

    def prefill(
        self,
        bases: Sequence[Caches | None],
        suffixes: Sequence[list[int]],
        want: Sequence[set[int]],
        prompts: Sequence[Prompt] | None = None,
    ) -> list[tuple[Caches, dict[int, Any]]]:
        """As ModelBackend.prefill; suffixes holding image positions run from their embeddings (those on bases
        of one length together), the rest together by token ids. Every cache comes back with its RoPE breaks."""
        from omlx_jobs.worker.vision.prefill import breaks_of, positioned

        starts = [b[0].offset if b else 0 for b in bases]
        media = [
            i
            for i, (s, suffix) in enumerate(zip(starts, suffixes, strict=True))
            if prompts is not None and has_media(prompts[i], s, s + len(suffix))
        ]
        out: dict[int, Any] = {}
        text = [i for i in range(len(suffixes)) if i not in media]
        if text:
            done = super().prefill([bases[i] for i in text], [suffixes[i] for i in text], [want[i] for i in text])
            for i, (caches, logits) in zip(text, done, strict=True):
                out[i] = (positioned(caches, breaks_of(bases[i])), logits)
        groups: dict[int, list[int]] = {}
        for i in media:  # rows on bases of one length run together, right-padded
            groups.setdefault(starts[i], []).append(i)
        for start, rows in groups.items():
            for k in range(0, len(rows), self.prefill_batch_size):
                chunk = rows[k : k + self.prefill_batch_size]
                assert prompts is not None
                done = self._prefill_media(chunk, start, bases, suffixes, want, prompts)
                out.update(done)
        return [out[i] for i in range(len(suffixes))]

    def _prefill_media(
        self,
        rows: list[int],
        start: int,
        bases: Sequence[Caches | None],
        suffixes: Sequence[list[int]],
        want: Sequence[set[int]],
        prompts: Sequence[Prompt],
    ) -> dict[int, tuple[Caches, dict[int, Any]]]:
        from omlx_jobs.worker.vision.prefill import prefill, prefill_rows

        ends = [start + len(suffixes[i]) for i in rows]
        views = [vision_prompt(prompts[i]) for i in rows]
        caches = [list(bases[i]) if bases[i] is not None else None for i in rows]
        if len(rows) == 1:
            i = rows[0]
            done = [prefill(self.vm, views[0], caches=caches[0], start=start, end=ends[0], want=want[i])]
        else:
            done = prefill_rows(self.vm, views, caches, ends, [want[i] for i in rows])
        return {i: (pf.caches, {j: pf.picked[j] for j in want[i]}) for i, pf in zip(rows, done, strict=True)}

    def media_prefix(
        self, cache: PrefixCache, prompt: Prompt, match: Match | None, position: int, *, keep: bool
    ) -> tuple[Match, int]:
        """A prefix covering every image of `prompt`, for its row to start from; and how many tokens were
        computed for it here (0 when a cached prefix already covers the images).

        The prefix is the best cached one (`match`), extended through the last image from embeddings. With
        `keep` (prefix reuse on) it goes into the prefix cache, held until admission passes `position`, and later
        requests with the same image after the same text reuse it; without, only this row takes it.
        """
        ready = self._ready.pop(position, None)
        if ready is not None:  # computed with its window (before_admit)
            return ready
        end = media_end(prompt)
        if match is not None and match.length >= end:
            cache.hold(match.entry, position)  # kept until the row has taken it
            return match, 0
        start = match.length if match is not None else 0
        base = kv.extendable(match.entry.value, match.entry.tokens, start) if match is not None else None
        ((caches, _),) = self.prefill([base], [prompt.tokens[start:end]], [set()], [prompt])
        key, size = prompt.prefix_key(end), kv.nbytes(caches)
        # Without prefix reuse the row takes the prefix directly, and it is gone with the row.
        entry = cache.add(key, caches, size, needed_until=position, pin=True) if keep else Entry(key, caches, size)
        return Match(entry, end), end - start
