"""Qwen3-VL: Qwen2-VL's prompt and mRoPE bookkeeping (interleaved sections), plus deepstack features.

- Positions: mlx-vlm's get_rope_index, as for Qwen2-VL (the per-request delta travels in the caches); the
  sections are interleaved across frequencies, which changes nothing for text (all three positions equal),
  so mlx-lm's qwen3_vl (a qwen3 text model with 1-D RoPE) decodes it exactly.
- Deepstack: the vision tower returns, beside the merged features, one feature set per deepstack layer; they
  are added to the hidden states of the first layers at the image positions. Here they are cached with the
  image (ImageFeatures.deep) and handed to mlx-vlm's language model chunk by chunk during prefill from
  embeddings (prefill.deep_inputs); decoding is text only, so it never needs them.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from omlx_jobs.worker.vision.families.base import ImageFeatures
from omlx_jobs.worker.vision.families.qwen2_vl import Qwen2VL


class Qwen3VL(Qwen2VL):
    mlx_lm_type = "qwen3_vl"

    def text_config(self, vm: Any) -> dict[str, Any]:
        text = dict(vm.config.get("text_config") or {})
        text.setdefault("tie_word_embeddings", vm.config.get("tie_word_embeddings", False))
        return {"model_type": "qwen3_vl", "text_config": {**text, "model_type": "qwen3"}}

    def encode(self, vm: Any, image: Any) -> ImageFeatures:
        out = vm.processor.image_processor(images=[image.pixels])
        pixels = mx.array(out["pixel_values"])
        grid = mx.array(out["image_grid_thw"]).reshape(1, 3)
        dtype = vm.model.vision_tower.patch_embed.proj.weight.dtype
        features, deep = vm.model.vision_tower(pixels.astype(dtype), grid)
        return ImageFeatures(features, grid, mx.stack(deep) if deep else None)

    def forward(
        self, vm: Any, ids: mx.array, embeds: mx.array, caches: list[Any], positions: Any, deep: Any = None
    ) -> mx.array:
        mask, features = deep if deep is not None else (None, None)
        return vm.model.language_model.model(
            ids,
            inputs_embeds=embeds,
            cache=caches,
            position_ids=positions,
            visual_pos_masks=mask,
            deepstack_visual_embeds=features,
        )

    def project(self, vm: Any, h: mx.array) -> mx.array:
        lm = vm.model.language_model
        return lm.model.embed_tokens.as_linear(h) if lm.args.tie_word_embeddings else lm.lm_head(h)
