"""Vision-language models through mlx-vlm: recognise, load, build image prompts, run the vision encoder.

Design (issue 11). Two ways to batch image requests were studied:

- mlx-vlm 0.7.10's own batch path (`mlx_vlm.generate.ar.BatchGenerator`, 3,600 lines): it batches image rows
  with its own caches, samplers, prefix cache (APC) and per-row mRoPE deltas. Checked on a tiny qwen2_vl
  (tests/test_vision.py): left-padded rows of different lengths and image sizes, a row joining mid-decode and a
  text row beside image rows all decode at the same positions, with the same greedy tokens, as single-request
  `mlx_vlm.generate`. The "one position off" the issue suspected does not reproduce on 0.7.10.
- oMLX's seed design, chosen here: run the vision encoder once per distinct image (cached by pixel hash),
  build the prompt's input embeddings, prefill them through mlx-vlm's language model into mlx-lm KV caches
  (worker/vision/prefill.py), then insert those caches into mlx-lm's BatchGenerator and decode with token
  ids through mlx-lm's own text model for the family, built on the same weight arrays (no copy).

Why: image rows then live in the one engine we already plan and measure: continuous batching with text rows,
the prefix trie and warm-ups (an image's key is its pixel hash), the CUDA ragged decode kernel, logits
processors, stop handling, the disk tier (vision/backend.py wires it).
mlx-vlm's generator would be a second engine beside it, with its own prefix cache and no way to take our
planned caches; and we depend only on mlx-vlm's model classes and processors, not on its fast-moving generate
module (the serial fallback aside).

Position state: Qwen2-VL's mRoPE gives image tokens 2-D positions, so after an image, a token's rotary
position is its index plus a per-request `rope_delta` (<= 0). mlx-vlm keeps that delta on the model object.
Here it belongs to the request: the prefill returns it, the row's caches carry it (PositionedKVCache, as the
delta after each image, so a cached prefix of any length knows its own), and when BatchGenerator merges caches
the delta is added to that row's offset, which mlx-lm's text model uses only as its RoPE position (masks use
the padding). Every later filter/extend keeps it. For text tokens all
three mRoPE sections hold the same position, so mlx-lm's 1-D RoPE is exact for decoding.

Families: each batched family has an adapter in vision/families/ (how the vision tower is called, the prompt's
image tokens, positions, caches, mlx-lm's twin): qwen2_vl, qwen2_5_vl, qwen3_vl, llava and gemma3, tested on
tiny fixtures (tests/tiny_vlm.py, tests/vision_fixtures.py). Every other vision model mlx-vlm loads runs one
request at a time on mlx-vlm's own generation loop (worker/vision/serial.py).
A quantized checkpoint's twin is quantized like the source (untested here).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from omlx_jobs.errors import ErrorCode
from omlx_jobs.jobs.images import ImageAccess
from omlx_jobs.jobs.parts import image_urls
from omlx_jobs.worker.cache.positioned import PositionedKVCache
from omlx_jobs.worker.prompts import ImageError, PromptError
from omlx_jobs.worker.vision.families import Family, family_of
from omlx_jobs.worker.vision.families.base import ImageFeatures
from omlx_jobs.worker.vision.feature_cache import FeatureCache
from omlx_jobs.worker.vision.inputs.images import DEFAULT_LIMITS, DecodedImage, ImageLimits, load_image
from omlx_jobs.worker.vision.prompt import ImageSpan, VisionPrompt, expand_image_tokens


def vision_model_type(config: dict[str, Any]) -> str | None:
    """The model type if `config` describes a vision-language model mlx-vlm can load, else None (text-only)."""
    model_type = str(config.get("model_type") or "").lower()
    if not model_type or not isinstance(config.get("vision_config"), dict):
        return None
    spec = importlib.util.find_spec("mlx_vlm")
    if spec is None or not spec.submodule_search_locations:
        return None
    models = Path(next(iter(spec.submodule_search_locations))) / "models"
    return model_type if (models / model_type).is_dir() else None


def is_batched(model_type: str) -> bool:
    """Whether image requests of this family decode in mlx-lm's BatchGenerator (else: one at a time)."""
    return family_of(model_type) is not None


class VisionModel:
    """An mlx-vlm model and processor, with what the engine needs: image prompts, features and a decode twin."""

    def __init__(self, path: Path, model: Any, processor: Any, config: dict[str, Any]) -> None:
        self.path = path
        self.model = model
        self.processor = processor
        self.config = config
        self.model_type = str(config["model_type"]).lower()
        self.tokenizer = getattr(processor, "tokenizer", processor)
        family = family_of(self.model_type)
        self.family: Family = family if family is not None and family.batches(self) else Family()
        self.image_token_id = self.family.image_token_id(self)  # -1: placed by the processor (serial)
        self.features: FeatureCache[ImageFeatures] = FeatureCache()
        self.batched = family is not None and self.family is family
        """Whether the engine decodes it in BatchGenerator; False runs it on serial.py (tests force it)."""
        self._decode_model: Any = None

    @classmethod
    def load(cls, path: str | Path) -> VisionModel:
        """Load a local model directory with mlx-vlm (offline: nothing is fetched from the Hub)."""
        path = Path(path)
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the processor falls back to the Hub for missing files
        from mlx_vlm.utils import load  # mlx-vlm is optional (the [vision] extra): imported when a model needs it

        model, processor = load(str(path))
        config = json.loads((path / "config.json").read_text())
        return cls(path, model, processor, config)

    @classmethod
    def with_weights(cls, path: str | Path, model: Any) -> VisionModel:
        """A model built in memory (random weights for benchmarks) with the processor files in `path`."""
        path = Path(path)
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from mlx_vlm.utils import load_processor  # optional dependency, as in `load`

        config = json.loads((path / "config.json").read_text())
        return cls(path, model, load_processor(path, eos_token_ids=config.get("eos_token_id")), config)

    @property
    def mrope(self) -> bool:
        return self.family.mrope

    # ---- images ------------------------------------------------------------------------------------

    def image_tokens(self, image: DecodedImage) -> int:
        """How many prompt tokens this image becomes, from its size alone (no pixels processed). A size the
        processor refuses (Qwen2-VL: an aspect ratio over 200) is an ImageError: the request fails alone."""
        try:
            return self.family.image_tokens(self, image)
        except Exception as exc:  # the processor's own checks raise ValueError; a port may raise anything
            raise processor_refused(image, exc) from None

    def image_features(self, image: DecodedImage) -> ImageFeatures:
        """The image's features, from the feature cache or by running the vision encoder once."""
        return self.features.get_or_compute(image.digest, lambda: self.encode(image))

    def encode(self, image: DecodedImage) -> ImageFeatures:
        """Preprocess and run the vision tower on one image (no cache)."""
        try:
            out = self.family.encode(self, image)
        except Exception as exc:  # the processor (or the tower) refusing this image fails its request alone
            raise processor_refused(image, exc) from None
        mx.eval([a for a in (out.features, out.deep) if a is not None])
        return out

    # ---- prompts -----------------------------------------------------------------------------------

    def build_prompt(self, messages: Sequence[dict[str, Any]], images: Sequence[DecodedImage]) -> VisionPrompt:
        """Chat template over the messages (image parts in place), each image expanded to its image tokens.

        `images` are the decoded image parts in prompt order (jobs/parts.image_urls).
        """
        limit = self.family.max_images
        if limit is not None and len(images) > limit:
            message = f"this model reads at most {limit} image(s) per request, got {len(images)}: split the request"
            raise ImageError(ErrorCode.IMAGE_REJECTED_BY_PROCESSOR, message)
        ids = list(self.tokenizer(self.family.expand_text(self, template_text(self, messages)))["input_ids"])
        counts = [self.image_tokens(im) for im in images]
        fills = [self.family.image_ids(self, im, n) for im, n in zip(images, counts, strict=True)]
        try:
            tokens, starts = expand_image_tokens(ids, self.image_token_id, counts, fills)
        except ValueError as exc:
            message = f"{exc}; the text must not hold the model's image token"
            raise ImageError(ErrorCode.INVALID_IMAGE, message) from None
        spans = tuple(ImageSpan(s, n, im.digest) for s, n, im in zip(starts, counts, images, strict=True))
        return VisionPrompt(tuple(tokens), spans, {"images": tuple(images)})

    def prepare(
        self, messages: Sequence[dict[str, Any]], access: ImageAccess, limits: ImageLimits = DEFAULT_LIMITS
    ) -> VisionPrompt:
        """A stored chat body's prompt: every image fetched (checked against this worker's `access`), decoded
        with `limits`, and placed. Raises ImageError or PromptError: the request fails alone."""
        pics = [load_image(url, access, limits) for _, _, url in image_urls(list(messages))]
        return self.build_prompt(messages, pics)

    # ---- decoding ----------------------------------------------------------------------------------

    def decode_model(self) -> Any:
        """mlx-lm's text model for this family, sharing this model's language weights (built once).

        It is what BatchGenerator runs: token ids in, logits out, 1-D RoPE at each row's cache offset.
        """
        if self._decode_model is None:
            if not self.batched:
                raise ValueError(f"{self.model_type} is not decoded in mlx-lm's BatchGenerator; run it unbatched")
            family = self.family
            self._decode_model = _twin(self.model.language_model, family.text_config(self), family)
        return self._decode_model


def processor_refused(image: DecodedImage, exc: Exception) -> ImageError:
    """The error of a request whose image the model's processor (or vision tower) refused."""
    text = str(exc) if len(str(exc)) <= 200 else str(exc)[:197] + "..."
    return ImageError(
        ErrorCode.IMAGE_REJECTED_BY_PROCESSOR,
        f"the model's image processor refused the {image.width}x{image.height} image ({type(exc).__name__}: "
        f"{text}); resize, crop or pad it",
    )


def template_text(vm: VisionModel, messages: Sequence[dict[str, Any]]) -> str:
    """The chat template over the messages, one image placeholder per image part: the processor's, or the
    tokenizer's where the processor keeps none (mlx-vlm's Gemma 3, Mistral 3 and LLaVA processors)."""
    template_messages, cont = _template_messages(messages)
    owner = vm.processor if getattr(vm.processor, "chat_template", None) else vm.tokenizer
    try:
        return owner.apply_chat_template(
            template_messages, add_generation_prompt=not cont, continue_final_message=cont, tokenize=False
        )
    except Exception as exc:  # jinja raises for roles or orders a template does not support
        raise PromptError(ErrorCode.CHAT_TEMPLATE_ERROR, f"the chat template rejected these messages: {exc}") from exc


def _template_messages(messages: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], bool]:
    """Messages for the processor's chat template: image_url parts become {"type": "image"}."""
    out = []
    for msg in messages:
        content = msg["content"]
        if isinstance(content, list):
            content = [{"type": "image"} if p["type"] == "image_url" else p for p in content]
        else:
            content = [{"type": "text", "text": content}]
        out.append({"role": msg["role"], "content": content})
    return out, messages[-1]["role"] == "assistant"


def _twin(language_model: Any, config: dict[str, Any], family: Family) -> Any:
    """Build mlx-lm's model for the family and point its parameters at `language_model`'s arrays."""
    mlx_lm_type = family.mlx_lm_type
    arch = importlib.import_module(f"mlx_lm.models.{mlx_lm_type}")
    model = arch.Model(arch.ModelArgs.from_dict(config))
    source = dict(tree_flatten(language_model.parameters()))
    # mlx-lm's qwen2_vl wraps its text model in `language_model`; llama and gemma3_text do not
    prefix = "language_model." if hasattr(model, "language_model") else ""
    quantized = {k.rsplit(".", 1)[0] for k in source if k.endswith(".scales")}
    if quantized:  # quantize the same layers the same way before sharing the arrays
        q = config.get("quantization") or config.get("quantization_config") or {}
        nn.quantize(
            model,
            group_size=q.get("group_size", 64),
            bits=q.get("bits", 4),
            class_predicate=lambda p, m: p.removeprefix(prefix) in quantized,
        )
    wanted = {k for k, _ in tree_flatten(model.parameters())}
    shared = [(f"{prefix}{k}", v) for k, v in source.items()]
    missing = wanted - {k for k, _ in shared}
    if missing:
        raise ValueError(f"mlx-lm's {mlx_lm_type} model has parameters the vision model lacks: {sorted(missing)[:3]}")
    model.update(tree_unflatten([(k, v) for k, v in shared if k in wanted]))
    if not family.sliding:  # full attention: every layer carries the row's RoPE delta
        layers = len(model.layers)
        model.make_cache = lambda: [PositionedKVCache() for _ in range(layers)]
    return model
