"""LLaVA (1.5): the plain embedding merge. A CLIP tower, one hidden layer's patches (CLS dropped), a projector.

Every image is resized and cropped to the processor's crop size, so each has the same number of tokens:
(crop / patch)^2 patches, plus the processor's additional tokens, less the CLS with the "default" strategy.
The language model is Llama with 1-D RoPE counted from the cache offset; mlx-lm's llama decodes it.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from omlx_jobs.worker.vision.families.base import Family, ImageFeatures


class Llava(Family):
    mlx_lm_type = "llama"

    def image_tokens(self, vm: Any, image: Any) -> int:
        proc = vm.processor
        crop = proc.image_processor.crop_size
        patch = proc.patch_size or vm.model.config.vision_config.patch_size
        n = (crop.height // patch) * (crop.width // patch) + (proc.num_additional_image_tokens or 0)
        return n - 1 if proc.vision_feature_select_strategy == "default" else n

    def encode(self, vm: Any, image: Any) -> ImageFeatures:
        model = vm.model
        pixels = mx.array(np.asarray(vm.processor.image_processor([image.pixels])["pixel_values"]))
        dtype = model.vision_tower.vision_model.embeddings.patch_embedding.weight.dtype
        *_, hidden = model.vision_tower(pixels.transpose(0, 2, 3, 1).astype(dtype), output_hidden_states=True)
        layers = model.vision_feature_layer
        picked = [hidden[i] for i in (layers if isinstance(layers, list) else [layers])]
        if model.vision_feature_select_strategy == "default":
            picked = [h[:, 1:] for h in picked]
        features = model.multi_modal_projector(mx.concatenate(picked, axis=-1))
        return ImageFeatures(features[0])
