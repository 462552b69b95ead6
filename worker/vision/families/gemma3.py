"""Gemma 3: a SigLIP tower pooled to a fixed number of tokens per image, sliding-window layers, scaled inputs.

- Prompt: the template's <start_of_image> becomes "\\n\\n<start_of_image>" + mm_tokens_per_image image tokens +
  "<end_of_image>\\n\\n" (the processor's full image sequence); every image has the same token count.
- Embeddings: the model multiplies every input embedding by sqrt(hidden), so image features go in divided by
  it (as mlx-vlm's prepare_inputs_for_multimodal does) and text embeddings go in unscaled.
- Attention: mlx-vlm 0.7.10 runs the prompt causally, image tokens included (its language model never takes
  the 4-D mask get_input_embeddings builds); transformers attends bidirectionally within an image. We follow
  mlx-vlm (docs/images.md).
- Caches: sliding-window layers hold mlx-lm's RotatingKVCache, which is reused only whole, never trimmed: the
  decode twin's make_cache reports them, so the engine's prefix cache and warm-up planner treat this model as
  untrimmable (a prefix is reused only when it is a whole cached entry, never cut back), and image prefixes of
  several rows are computed one row at a time (a right-padded rotating cache cannot be cut at a row's end).
- Pan-and-scan crops change an image's token count by its pixels: such checkpoints stay serial (`batches`).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from omlx_jobs.worker.vision.families.base import Family, ImageFeatures


class Gemma3(Family):
    mlx_lm_type = "gemma3_text"
    sliding = True

    def batches(self, vm: Any) -> bool:
        return not getattr(vm.processor.image_processor, "do_pan_and_scan", False)

    def text_config(self, vm: Any) -> dict[str, Any]:
        text = super().text_config(vm)
        theta = text.get("rope_global_base_freq", text.get("rope_theta", 1_000_000.0))  # mlx-vlm's name for it
        return {**text, "model_type": "gemma3_text", "rope_theta": theta}

    def expand_text(self, vm: Any, text: str) -> str:
        tok = vm.processor.tokenizer
        return text.replace(tok.boi_token, f"\n\n{tok.boi_token}{tok.image_token}{tok.eoi_token}\n\n")

    def image_tokens(self, vm: Any, image: Any) -> int:
        return int(vm.model.config.text_config.mm_tokens_per_image)

    def encode(self, vm: Any, image: Any) -> ImageFeatures:
        model = vm.model
        out = vm.processor.image_processor([image.pixels], do_pan_and_scan=False)
        pixels = mx.array(np.asarray(out["pixel_values"]))
        dtype = model.language_model.model.norm.weight.dtype
        hidden, _, _ = model.vision_tower(pixels.transpose(0, 2, 3, 1).astype(dtype), output_hidden_states=True)
        features = model.multi_modal_projector(hidden)[0]
        return ImageFeatures(features / (model.config.hidden_size**0.5))  # the top-level hidden_size, as mlx-vlm
