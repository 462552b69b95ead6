"""Tiny random-weight checkpoints of Mistral 3 and Pixtral (tests/vision_fixtures.py's way: mlx-vlm's own model
classes, a BPE tokenizer trained offline, processor configs written here, only the tokenizer keeping the chat
template).

- mistral3: a Ministral 3 text model (Llama 4 attention scaling from position 16 on, YaRN RoPE) under a Pixtral
  tower with a 2 x 2 patch merger: images up to 64 pixels a side, 8-pixel patches, 1 to 4 rows of 1 to 4 tokens.
- mistral3_small: the same with a Mistral (Llama-like) text model, as Mistral Small 3.1 / 3.2 have.
- pixtral: a Mistral text model with an untied head, the same tower without a merger: 1 to 8 rows of 1 to 8
  tokens.
- llava_next: see build_llava_next.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.vision_fixtures import MEAN, STD, TEXT, VISION, _finish, _pixels, _tokenizer, _write_configs

MISTRAL_TEMPLATE = (
    "{{ '<s>' }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ '[SYSTEM_PROMPT]' }}{% elif message['role'] == 'user' %}{{ '[INST]' }}"
    "{% endif %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '[IMG]' }}{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% if message['role'] == 'system' %}{{ '[/SYSTEM_PROMPT]' }}"
    "{% elif message['role'] == 'user' %}{{ '[/INST]' }}{% else %}{{ '</s>' }}{% endif %}{% endfor %}"
)
SPECIALS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"]
SPECIALS += ["[IMG]", "[IMG_BREAK]", "[IMG_END]"]
EDGE, PATCH = 64, 8


def build_mistral3(path: Path | str, *, seed: int = 0, shape: dict[str, Any] | None = None) -> Path:
    """A tiny Mistral 3 with a Ministral 3 text model. `shape` as in mistral3_files."""
    path, config, image, processor = mistral3_files(path, shape=shape)
    return _finish(path, config, image, processor, seed)


def build_mistral3_small(path: Path | str, *, seed: int = 0) -> Path:
    """A tiny Mistral 3 as Mistral Small 3.1 / 3.2 are: a Mistral (Llama-like) text model under the merger."""
    return build_mistral3(path, seed=seed, shape={"text_type": "mistral"})


def build_pixtral(path: Path | str, *, seed: int = 0) -> Path:
    """A tiny Pixtral: Mistral text model, no patch merger."""
    path, config, image, processor = mistral3_files(path, model_type="pixtral")
    return _finish(path, config, image, processor, seed)


def mistral3_files(
    path: Path | str, *, model_type: str = "mistral3", shape: dict[str, Any] | None = None
) -> tuple[Path, dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Tokenizer files of a Mistral 3 (or Pixtral) checkpoint, and its configs. `shape` ("text_type": mistral or
    ministral3, "text", "rope" (Ministral 3's rope_parameters), "vision", "edge", "patch", "model_vocab";
    bench/engine/vision.py's MISTRAL3_SHAPES) overrides the tiny sizes."""
    path = Path(path)
    shape = shape or {}
    edge, patch = shape.get("edge", EDGE), shape.get("patch", PATCH)
    ids = _tokenizer(path, SPECIALS, "</s>", MISTRAL_TEMPLATE, {}, model_vocab=shape.get("model_vocab"))
    text = {
        **TEXT,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-5,
        "vocab_size": ids["vocab"],
        "max_position_embeddings": 1024,
        "tie_word_embeddings": False,
    }
    if shape.get("text_type", "ministral3" if model_type == "mistral3" else "mistral") == "ministral3":
        rope = {"rope_type": "yarn", "type": "yarn", "rope_theta": 10000.0, "factor": 64.0, "beta_fast": 32.0}
        rope.update(beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)
        rope.update(original_max_position_embeddings=16, llama_4_scaling_beta=0.1)
        rope.update(shape.get("rope", {}))
        text.update(model_type="ministral3", rope_parameters=rope)
    else:
        text.update(model_type="mistral", rope_theta=10000.0)
    text.update(shape.get("text", {}))
    vision = {**VISION, "model_type": "pixtral", "head_dim": 16, "image_size": edge, "patch_size": patch}
    vision.update(rope_theta=10000.0, rms_norm_eps=1e-5, **shape.get("vision", {}))
    merge = 2 if model_type == "mistral3" else 1
    config = {
        "model_type": model_type,
        "architectures": ["Mistral3ForConditionalGeneration" if merge == 2 else "LlavaForConditionalGeneration"],
        "image_token_index": ids["[IMG]"],
        "vision_feature_layer": -1,
        "spatial_merge_size": merge,
        "multimodal_projector_bias": False,
        "vocab_size": ids["vocab"],
        "eos_token_id": ids["</s>"],
        "text_config": text,
        "vision_config": vision,
    }
    image = {
        "image_processor_type": "PixtralImageProcessor",
        "size": {"longest_edge": edge},
        "patch_size": {"height": patch, "width": patch},
        **_pixels(MEAN, STD, resample=3),
    }
    processor = {"processor_class": "PixtralProcessor", "patch_size": patch, "spatial_merge_size": merge}
    _write_configs(path, config, image, processor)
    return path, config, image, processor


BUILDERS = {"mistral3": build_mistral3, "mistral3_small": build_mistral3_small, "pixtral": build_pixtral}


def build_llava_next(path: Path | str, *, seed: int = 0) -> Path:
    """A tiny LLaVA-NeXT: a CLIP tower over 42-pixel crops (3 x 3 patches), pinpoints of 1 x 2, 2 x 1 and 2 x 2
    crops: 3 or 5 crops per image, 54 or 90 image positions as mlx-vlm runs them."""
    from tests.vision_fixtures import LLAVA_TEMPLATE

    path = Path(path)
    ids = _tokenizer(path, ["<unk>", "<s>", "</s>", "<image>"], "</s>", LLAVA_TEMPLATE, {"image_token": "<image>"})
    text = {**TEXT, "model_type": "llama", "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "rope_theta": 10000.0}
    crop, patch = 42, 14
    pinpoints = [[crop, 2 * crop], [2 * crop, crop], [2 * crop, 2 * crop]]
    config = {
        "model_type": "llava_next",
        "architectures": ["LlavaNextForConditionalGeneration"],
        "image_token_index": ids["<image>"],
        "vision_feature_select_strategy": "default",
        "vision_feature_layer": -2,
        "image_grid_pinpoints": pinpoints,
        "vocab_size": ids["vocab"],
        "eos_token_id": ids["</s>"],
        "text_config": {**text, "vocab_size": ids["vocab"], "max_position_embeddings": 1024},
        "vision_config": {
            **VISION,
            "model_type": "clip_vision_model",
            "image_size": crop,
            "patch_size": patch,
            "projection_dim": 32,
        },
    }
    image = {
        "image_processor_type": "LlavaNextImageProcessor",
        "size": {"shortest_edge": crop},
        "crop_size": {"height": crop, "width": crop},
        "image_grid_pinpoints": pinpoints,
        **_pixels(MEAN, STD, resample=3),
        "do_center_crop": True,
        "do_pad": True,
    }
    processor = {
        "processor_class": "LlavaNextProcessor",
        "patch_size": patch,
        "vision_feature_select_strategy": "default",
        "num_additional_image_tokens": 1,
    }
    return _finish(path, config, image, processor, seed)


BUILDERS["llava_next"] = build_llava_next
