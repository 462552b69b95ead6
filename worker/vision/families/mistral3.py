"""Mistral 3 and Pixtral: a Pixtral tower (2-D RoPE) over each image at its own size, rows of image tokens.

- Prompt: the template's [IMG] becomes one row of [IMG] tokens per row of patches, an [IMG_BREAK] after every
  row but the last and an [IMG_END] after it, as mlx-vlm's processor writes it. The image is first resized to
  fit the processor's longest edge, each side rounded up to patch_size * spatial_merge_size (its own aspect
  ratio), so the token count comes from the image's size alone. The break and end positions hold those
  tokens' own embeddings: the image's span covers them, and its features are the tower's rows with the two
  embeddings between them (a span is one run of positions; its prompt ids are the processor's).
- Vision: mlx-vlm's Pixtral tower (2-D RoPE from each patch's row and column, one image at a time: the
  block-diagonal mask mlx-vlm builds for several images keeps them apart, so alone is the same), one hidden
  layer, then Mistral 3's RMS norm, patch merger and projector (Pixtral's projector has no merger).
- Text: Mistral 3's text model is mlx-vlm's Mistral (Llama-like: mlx-lm's llama, through its mistral3 or pixtral
  wrapper) or Ministral 3 (mlx-lm's ministral3: Llama 4 attention scaling by position, from the cache offset).
  The twin is built from mlx-vlm's parsed text config, its defaults included (mlx-lm's differ). What neither
  twin computes as mlx-vlm does stays serial (`batches`): Mistral 4, q/k norms, sliding-window layers, RoPE
  scaling mlx-vlm's Mistral ignores.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import mlx.core as mx
import numpy as np

from omlx_jobs.worker.vision.families.base import Family, ImageFeatures


class Mistral3(Family):
    mlx_lm_type = "mistral3"

    def batches(self, vm: Any) -> bool:
        text = vm.model.language_model.config
        scaling = getattr(text, "rope_scaling", None)
        return (
            text.model_type != "mistral4"
            and not getattr(text, "use_qk_norm", False)
            and all(t == "full_attention" for t in getattr(text, "layer_types", None) or ())
            and (scaling is None or scaling.get("type") == "linear" or text.model_type == "ministral3")
            and not (text.model_type == "ministral3" and text.rope_traditional)
            and bool(vm.processor.image_processor.do_resize)
        )

    def text_config(self, vm: Any) -> dict[str, Any]:
        text = dataclasses.asdict(vm.model.language_model.config)
        tied = getattr(vm.model.language_model, "lm_head", None) is None
        text.update(tie_word_embeddings=tied, attention_bias=False, mlp_bias=False)  # mlx-vlm's Mistral has none
        quant = {k: v for k, v in vm.config.items() if k in ("quantization", "quantization_config")}  # for _twin
        return {"model_type": self.mlx_lm_type, "text_config": text, **quant}

    def grid(self, vm: Any, image: Any) -> tuple[int, int]:
        """(rows, columns) of image tokens: the processor's resize, in units of patch_size * merge."""
        from mlx_vlm.models.pixtral import image_processing_pixtral as pip  # optional: the [vision] extra

        proc = vm.processor
        unit = proc.patch_size * proc.spatial_merge_size
        size = pip._size_to_pair(proc.image_processor.size)
        height, width = pip.get_resize_output_image_size((image.height, image.width), size=size, patch_size=unit)
        return height // unit, width // unit

    def image_tokens(self, vm: Any, image: Any) -> int:
        rows, cols = self.grid(vm, image)
        return rows * (cols + 1)

    def image_ids(self, vm: Any, image: Any, count: int) -> list[int]:
        proc = vm.processor
        rows, cols = self.grid(vm, image)
        ids = ([proc.image_token_id] * cols + [proc.image_break_token_id]) * rows
        return ids[:-1] + [proc.image_end_token_id]

    def project_image(self, vm: Any, selected: mx.array, sizes: list[tuple[int, int]]) -> mx.array:
        """The selected hidden layer's patches (1, patches, hidden) -> image features (tokens, text hidden)."""
        return vm.model.multi_modal_projector(selected[0], sizes)

    def encode(self, vm: Any, image: Any) -> ImageFeatures:
        proc, model = vm.processor, vm.model
        out = proc.image_processor([image.pixels], patch_size=proc.patch_size * proc.spatial_merge_size)
        pixels = mx.array(np.asarray(out["pixel_values"]))
        sizes = [tuple(int(v) for v in s) for s in out["image_sizes"]]
        dtype = model.vision_tower.vision_model.patch_conv.weight.dtype
        *_, hidden = model.vision_tower(
            pixels.transpose(0, 2, 3, 1).astype(dtype), output_hidden_states=True, image_sizes=sizes
        )
        features = self.project_image(vm, hidden[model.vision_feature_layer], sizes)
        rows, cols = self.grid(vm, image)
        marks = self.embed(vm, mx.array([proc.image_break_token_id, proc.image_end_token_id])).astype(features.dtype)
        grid = features.reshape(rows, cols, -1)
        breaks = mx.broadcast_to(marks[0], (rows, 1, grid.shape[-1]))
        body = mx.concatenate([grid, breaks], axis=1).reshape(rows * (cols + 1), -1)
        return ImageFeatures(mx.concatenate([body[:-1], marks[1:]], axis=0))


class Pixtral(Mistral3):
    """Pixtral: Mistral 3's prompt and tower without the patch merger; the text model always has its own head."""

    mlx_lm_type = "pixtral"

    def project_image(self, vm: Any, selected: mx.array, sizes: list[tuple[int, int]]) -> mx.array:
        return vm.model.multi_modal_projector(selected)[0]
