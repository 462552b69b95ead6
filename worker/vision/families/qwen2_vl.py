"""Qwen2-VL and Qwen2.5-VL: images sized by the processor's own rule, mRoPE positions, the RoPE delta per row.

mRoPE gives image tokens 2-D positions, so text after an image runs at its index plus a per-request delta
(<= 0); mlx-vlm's get_rope_index computes positions and delta, and the row's caches carry the delta
(cache/positioned.py). The decode twin is mlx-lm's qwen2_vl (1-D RoPE is exact for text tokens).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from omlx_jobs.worker.vision.families.base import Family, ImageFeatures


class Qwen2VL(Family):
    mlx_lm_type = "qwen2_vl"
    mrope = True

    def text_config(self, vm: Any) -> dict[str, Any]:
        return vm.config

    def image_tokens(self, vm: Any, image: Any) -> int:
        return int(vm.processor.image_processor.num_image_tokens(image.height, image.width))

    def image_grid(self, vm: Any, image: Any) -> mx.array:
        """(1, 3) patch grid (temporal, height, width) the processor gives this image, from its size alone."""
        proc = vm.processor.image_processor
        height, width = proc._resolved_size(image.height, image.width)  # the sizing num_image_tokens uses
        return mx.array([[1, height // proc.patch_size, width // proc.patch_size]])

    def encode(self, vm: Any, image: Any) -> ImageFeatures:
        out = vm.processor.image_processor(images=[image.pixels])
        pixels = mx.array(out["pixel_values"])
        grid = mx.array(out["image_grid_thw"]).reshape(1, 3)
        dtype = vm.model.vision_tower.patch_embed.proj.weight.dtype
        return ImageFeatures(vm.model.vision_tower(pixels.astype(dtype), grid, output_hidden_states=False), grid)

    def positions(self, vm: Any, prompt: Any, features: list[Any]) -> tuple[mx.array | None, int]:
        if not prompt.spans:
            return None, 0  # text positions: the model counts them from the cache offset
        images = prompt.extra.get("images", ())
        grids = [f.grid if f is not None else self.image_grid(vm, im) for f, im in zip(features, images, strict=True)]
        grid = mx.concatenate(grids, axis=0) if grids else None
        positions, deltas = vm.model.language_model.get_rope_index(mx.array([prompt.tokens]), grid)
        return positions, int(mx.array(deltas).reshape(-1)[0].item())

    def forward(
        self, vm: Any, ids: mx.array, embeds: mx.array, caches: list[Any], positions: Any, deep: Any = None
    ) -> mx.array:
        return vm.model.language_model.model(ids, inputs_embeds=embeds, cache=caches, position_ids=positions)

    def project(self, vm: Any, h: mx.array) -> mx.array:
        lm = vm.model.language_model
        return lm.model.embed_tokens.as_linear(h) if lm.args.tie_word_embeddings else lm.lm_head(h)
