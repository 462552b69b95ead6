"""The family adapter protocol, with the plain embedding-merge case as its defaults.

A family adapter says, for one mlx-vlm model family, everything the image prefill (vision/prefill.py) and the
decode twin (vision/model.py) need that differs between families:
- prompts: how the chat template's image placeholder becomes the image's tokens (`expand_text`, `image_tokens`);
- images: how the vision tower turns one image into features in the text model's input space (`encode`);
- the language model's inputs: text embeddings (`embed`), positions (`positions`: mRoPE families only) and the
  forward pass from embeddings (`forward`), its vocabulary projection (`project`);
- caches: the decode twin's make_cache gives the layer caches: PositionedKVCache layers (they carry an mRoPE
  row's delta), or with `sliding` mlx-lm's own (rotating ones for sliding-window layers);
- the decode twin: mlx-lm's model type and config that decode the family by token ids (`mlx_lm_type`,
  `text_config`).
The defaults are LLaVA's: one embedding table, 1-D RoPE counted from the cache offset, a Llama-like body.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx


@dataclass
class ImageFeatures:
    """The vision encoder's output for one image: features in the text model's input space, and what the
    family needs beside them."""

    features: Any  # mx.array (image tokens, hidden)
    grid: Any = None  # Qwen2-VL / Qwen3-VL: mx.array (1, 3) temporal, height, width patches
    deep: Any = None  # Qwen3-VL: mx.array (deepstack layers, image tokens, hidden), added to early layers

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in (self.features, self.grid, self.deep) if a is not None)

    @property
    def tokens(self) -> int:
        return int(self.features.shape[0])


class Family:
    """One mlx-vlm family's glue; subclasses override what their model does differently."""

    mlx_lm_type = "llama"
    """mlx-lm's text model that decodes the family with token ids, sharing the language model's weights."""
    mrope = False
    """Whether positions are 3-D (mRoPE): text after an image then runs at its index plus a RoPE delta."""
    max_images: int | None = None
    """The most images one prompt may hold (LLaVA-NeXT: mlx-vlm reads only the first); None: no limit."""
    sliding = False
    """Sliding-window layers: the decode twin keeps mlx-lm's own caches (rotating ones, never trimmed) instead
    of PositionedKVCache layers, and image prefixes of several rows run one row at a time (a right-padded
    rotating cache cannot be cut back at a row's end)."""

    def batches(self, vm: Any) -> bool:
        """Whether this checkpoint batches (a family may leave some of its configurations serial)."""
        return True

    def text_config(self, vm: Any) -> dict[str, Any]:
        """The config mlx-lm's text model is built from: the text config, with the top level's missing keys, and
        whether the head is tied as mlx-vlm built it (mlx-lm's defaults differ: llama ties unless told)."""
        config = vm.config
        text = dict(config.get("text_config") or {})
        top = {k: v for k, v in config.items() if k not in ("text_config", "vision_config")}
        tied = getattr(vm.model.language_model, "lm_head", None) is None
        return {**top, **text, "tie_word_embeddings": tied}

    def image_token_id(self, vm: Any) -> int:
        cfg = vm.model.config
        token = getattr(cfg, "image_token_id", None) or getattr(cfg, "image_token_index", None)
        token = token if token is not None else vm.config.get("image_token_id", vm.config.get("image_token_index"))
        return int(token) if token is not None else -1

    def expand_text(self, vm: Any, text: str) -> str:
        """The template text with each image's placeholder as the processor rewrites it (one image token)."""
        return text

    def image_tokens(self, vm: Any, image: Any) -> int:
        """How many prompt tokens one image becomes, from its size alone."""
        raise NotImplementedError

    def image_ids(self, vm: Any, image: Any, count: int) -> list[int]:
        """The prompt ids of one image's `count` positions: its image token throughout (Pixtral's rows of image
        tokens have break and end tokens among them)."""
        return [self.image_token_id(vm)] * count

    def encode(self, vm: Any, image: Any) -> ImageFeatures:
        """The vision tower's features for one image, (tokens, hidden) in the input embeddings' space."""
        raise NotImplementedError

    def embed(self, vm: Any, ids: mx.array) -> mx.array:
        """Text tokens' input embeddings, as the language model takes them with `inputs_embeds`."""
        return vm.model.language_model.model.embed_tokens(ids)

    def positions(self, vm: Any, prompt: Any, features: list[Any]) -> tuple[mx.array | None, int]:
        """Position ids for the whole prompt and the RoPE delta after it (None, 0: counted from the cache)."""
        return None, 0

    def forward(
        self, vm: Any, ids: mx.array, embeds: mx.array, caches: list[Any], positions: Any, deep: Any = None
    ) -> mx.array:
        """The language model's hidden states (before the vocabulary projection) from input embeddings.
        `deep`: Qwen3-VL's (image-position mask, deepstack features) of this chunk, None elsewhere."""
        return vm.model.language_model.model(ids, inputs_embeds=embeds, cache=caches)

    def project(self, vm: Any, h: mx.array) -> mx.array:
        lm = vm.model.language_model
        if getattr(lm, "lm_head", None) is None:
            return lm.model.embed_tokens.as_linear(h)
        return lm.lm_head(h)
