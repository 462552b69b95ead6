"""LLaVA-NeXT: any-resolution tiling (the whole image and the tiles of its best grid pinpoint), a CLIP tower, a
projector, image_newline rows; as mlx-vlm 0.7.10 computes it, which departs from the reference (docs/images.md).

- Tiles: the image processor picks the pinpoint that fits the image best, resizes and pads the image to it and cuts
  it into crop-size tiles; with the whole image resized to the crop size first, that is 1 + tiles crops.
- Features: mlx-vlm runs the tower on the crops, drops the CLS ("default"), projects each crop's patches, then
  appends as many crops' worth of image_newline rows (one newline crop per crop), and puts those 2 x crops x
  patches rows where the prompt's image tokens start, whatever their count: the prompt then holds exactly that
  many image positions (its own processor's count, from unpadding, is not what the model runs). transformers
  instead unpads the tiles to the image's aspect ratio and puts one newline after each row of patches.
- Images: mlx-vlm reads only the first image of a prompt (later images, and the text between them, are dropped),
  so a request with more than one image fails alone (`max_images`).
- Text: mlx-vlm's own Llama (head size hidden / heads, always an untied head): mlx-lm's llama, built from the
  parsed text config (mlx-vlm's defaults, not mlx-lm's).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import mlx.core as mx
import numpy as np

from omlx_jobs.worker.vision.families.base import Family, ImageFeatures


class LlavaNext(Family):
    mlx_lm_type = "llama"
    max_images = 1

    def batches(self, vm: Any) -> bool:
        scaling = vm.model.language_model.config.rope_scaling
        return vm.model.vision_feature_select_strategy in ("default", "full") and (
            scaling is None or scaling.get("type") == "linear"
        )

    def text_config(self, vm: Any) -> dict[str, Any]:
        text = dataclasses.asdict(vm.model.language_model.config)
        quant = {k: v for k, v in vm.config.items() if k in ("quantization", "quantization_config")}  # for _twin
        return {**text, **quant, "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False}

    def crops(self, vm: Any, image: Any) -> int:
        """The crops the image processor gives this image: the whole image, and the tiles of its best pinpoint."""
        from transformers.image_processing_utils import select_best_resolution  # with mlx-vlm (the [vision] extra)

        proc = vm.processor.image_processor
        height, width = select_best_resolution((image.height, image.width), proc.image_grid_pinpoints)
        crop = _edge(proc.crop_size)
        return 1 + (height // crop) * (width // crop)

    def image_tokens(self, vm: Any, image: Any) -> int:
        vision = vm.model.config.vision_config
        patches = (vision.image_size // vision.patch_size) ** 2
        per_crop = patches if vm.model.vision_feature_select_strategy == "default" else patches + 1
        return 2 * self.crops(vm, image) * per_crop

    def encode(self, vm: Any, image: Any) -> ImageFeatures:
        model = vm.model
        out = vm.processor.image_processor([image.pixels], do_pad=True)
        pixels = mx.array(np.asarray(out["pixel_values"][0]))
        dtype = model.vision_tower.vision_model.embeddings.patch_embedding.weight.dtype
        *_, hidden = model.vision_tower(pixels.transpose(0, 2, 3, 1).astype(dtype), output_hidden_states=True)
        selected = hidden[model.vision_feature_layer]
        if model.vision_feature_select_strategy == "default":
            selected = selected[:, 1:]
        features = model.multi_modal_projector(selected)
        newline = mx.broadcast_to(model.image_newline.astype(features.dtype), features.shape)
        return ImageFeatures(mx.concatenate([features, newline], axis=0).reshape(-1, features.shape[-1]))


def _edge(size: Any) -> int:
    """A crop size's height, as the image processor reads it (a SizeDict, a dict or an int)."""
    if isinstance(size, dict):
        return int(size.get("height") or size["shortest_edge"])
    return int(getattr(size, "height", None) or getattr(size, "shortest_edge", None) or size)
