"""A vision model loaded for the engine: its prompts (images fetched, decoded and placed) and its backend."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mlx_lm.utils import load_tokenizer

from omlx_jobs.jobs.formats import CHAT_URL
from omlx_jobs.jobs.images import ImageAccess
from omlx_jobs.jobs.parts import image_urls
from omlx_jobs.worker.backend.model import ModelBackend
from omlx_jobs.worker.models.loaded import LoadedModel
from omlx_jobs.worker.models.paths import ModelLoadError, context_length_of, model_identity
from omlx_jobs.worker.prompts import Prompt
from omlx_jobs.worker.vision.backend import VisionBackend
from omlx_jobs.worker.vision.inputs.images import DEFAULT_LIMITS, ImageLimits, fetch
from omlx_jobs.worker.vision.inputs.media import Fetcher, ImageMedia, ImageMemo, ImageRef
from omlx_jobs.worker.vision.inputs.prefetch import RemotePrefetch, is_remote
from omlx_jobs.worker.vision.model import VisionModel, template_text


@dataclass(frozen=True, eq=False)
class TemplatePrompt(Prompt):
    """A prompt for the serial fallback: the chat template's text and the images, for mlx-vlm's processor to
    expand (other families place image tokens their own way). `tokens` hold one image token per image, so
    the true prompt length is known only once the processor has run (serial.py reports it)."""

    text: str = ""
    images: tuple[ImageRef, ...] = ()

    @classmethod
    def build(cls, vm: VisionModel, messages: list[dict[str, Any]], refs: list[ImageRef]) -> TemplatePrompt:
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
    prefetch: RemotePrefetch | None = field(default=None, repr=False)

    def want_images(self, bodies: list[tuple[str, dict[str, Any]]]) -> None:
        """Start fetching the remote images of these (endpoint, body) requests (a shard's page), several at once."""
        urls = [u for e, b in bodies if e == CHAT_URL for _, _, u in image_urls(b["messages"]) if is_remote(u)]
        urls = [u for u in urls if not self.memo.has(u)]
        if urls and self.access.allow_remote:
            if self.prefetch is None or self.prefetch.access != self.access:
                self.prefetch = RemotePrefetch(self.access)
            self.prefetch.want(urls)

    def _fetcher(self, url: str) -> Fetcher:
        return self.prefetch.take if self.prefetch is not None and is_remote(url) else fetch

    def prompt(self, endpoint: str, body: dict[str, Any]) -> Prompt:
        """A chat request's prompt through the processor's template, each image fetched, decoded and placed."""
        if endpoint != CHAT_URL:  # a completions prompt: text, tokenized as for any model
            return Prompt.from_tokens(LoadedModel.encode(self, endpoint, body))
        vm = self.vision
        assert vm is not None
        messages = body["messages"]
        refs = [self.memo.load(u, self.access, self.limits, self._fetcher(u)) for _, _, u in image_urls(messages)]
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
    try:
        vm = VisionModel.load(path)
    except Exception as exc:
        raise ModelLoadError(f"mlx-vlm could not load {path}: {exc}") from exc
    return loaded_vision(vm, ref, context_length=context_length, images=images)


def loaded_vision(
    vm: VisionModel, ref: str, *, context_length: int | None = None, images: ImageAccess | None = None
) -> VisionLoaded:
    """The engine's model for a loaded (or built in memory) VisionModel, reading images as `images` allows."""
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
