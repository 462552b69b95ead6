"""Tiny random-weight checkpoints of the vision families beside Qwen2-VL (tests/tiny_vlm.py): LLaVA and Gemma 3.

Each is built from mlx-vlm's own model classes (the same ModelConfig / update_module_configs steps its loader
takes), with random weights sharpened so that greedy picks depend on the image and the text before them, a
byte-level BPE tokenizer trained offline, and processor configs written here; nothing is fetched. As in real
checkpoints of these families, only the tokenizer keeps the chat template (mlx-vlm's processors do not), so the
prompt must come from the tokenizer's template. The image processors are transformers' PIL ones (no torch).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.tiny_vlm import _CORPUS

MEAN = [0.48145466, 0.4578275, 0.40821073]
STD = [0.26862954, 0.26130258, 0.27577711]

LLAVA_TEMPLATE = (
    "{% for message in messages %}{{ message['role'].upper() + ': ' }}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>\n' }}{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{{ '</s>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)

GEMMA3_TEMPLATE = (
    "{{ '<bos>' }}{% for message in messages %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n' }}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<start_of_image>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{{ '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)

TEXT = {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128, "num_attention_heads": 4}
VISION = {"num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2}
IMAGE_SIZE, PATCH = 56, 14  # 4 x 4 patches per image


def build_llava(path: Path | str, *, seed: int = 0) -> Path:
    """A tiny LLaVA 1.5 (CLIP tower, Llama text model): 16 image tokens per image."""
    path = Path(path)
    ids = _tokenizer(path, ["<unk>", "<s>", "</s>", "<image>"], "</s>", LLAVA_TEMPLATE, {"image_token": "<image>"})
    text = {**TEXT, "model_type": "llama", "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "rope_theta": 10000.0}
    config = {
        "model_type": "llava",
        "architectures": ["LlavaForConditionalGeneration"],
        "image_token_index": ids["<image>"],
        "vision_feature_select_strategy": "default",
        "vision_feature_layer": -2,
        "vocab_size": ids["vocab"],
        "eos_token_id": ids["</s>"],
        "text_config": {**text, "vocab_size": ids["vocab"], "max_position_embeddings": 1024},
        "vision_config": {
            **VISION,
            "model_type": "clip_vision_model",
            "image_size": IMAGE_SIZE,
            "patch_size": PATCH,
            "projection_dim": 32,
        },
    }
    image = {
        "image_processor_type": "CLIPImageProcessor",
        "size": {"shortest_edge": IMAGE_SIZE},
        "crop_size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        **_pixels(MEAN, STD, resample=3),
        "do_center_crop": True,
    }
    processor = {
        "processor_class": "LlavaProcessor",
        "patch_size": PATCH,
        "vision_feature_select_strategy": "default",
        "num_additional_image_tokens": 1,
    }
    return _finish(path, config, image, processor, seed)


def build_gemma3(path: Path | str, *, seed: int = 0, sliding_window: int = 16) -> Path:
    """A tiny Gemma 3: layer 0 slides over `sliding_window` tokens, layer 1 attends globally; 4 tokens per image
    (4 x 4 SigLIP patches average-pooled 2 x 2)."""
    path, config, image, processor = gemma3_files(path, sliding_window=sliding_window)
    return _finish(path, config, image, processor, seed)


def gemma3_files(
    path: Path | str, *, sliding_window: int = 16, shape: dict[str, Any] | None = None
) -> tuple[Path, dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Tokenizer files of a Gemma 3 checkpoint, and its config and processor configs (written by _finish).
    `shape` ("text", "vision", "image_size", "model_vocab"; bench/engine/vision.py's GEMMA3_SHAPES) overrides the
    tiny sizes."""
    path = Path(path)
    shape = shape or {}
    size = shape.get("image_size", IMAGE_SIZE)
    specials = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"]
    specials += ["<start_of_image>", "<end_of_image>", "<image_soft_token>"]
    extra = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
    ids = _tokenizer(
        path, specials, "<end_of_turn>", GEMMA3_TEMPLATE, extra, pad="<pad>", model_vocab=shape.get("model_vocab")
    )
    text = {
        **TEXT,
        "model_type": "gemma3_text",
        "num_key_value_heads": 2,
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "sliding_window": sliding_window,
        "sliding_window_pattern": 2,
        "mm_tokens_per_image": 4,
        "rope_global_base_freq": 1_000_000.0,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "rms_norm_eps": 1e-6,
        "vocab_size": ids["vocab"],
        "max_position_embeddings": 1024,
    }
    config = {
        "model_type": "gemma3",
        "architectures": ["Gemma3ForConditionalGeneration"],
        "image_token_index": ids["<image_soft_token>"],
        "pad_token_id": ids["<pad>"],
        "eos_token_id": [ids["<end_of_turn>"]],
        "vocab_size": ids["vocab"],
        "text_config": text,
        "vision_config": {
            **VISION,
            **shape.get("vision", {}),
            "model_type": "siglip_vision_model",
            "image_size": size,
            "patch_size": PATCH,
            "layer_norm_eps": 1e-6,
        },
    }
    text.update(shape.get("text", {}))
    image = {
        "image_processor_type": "Gemma3ImageProcessor",
        "size": {"height": size, "width": size},
        **_pixels([0.5] * 3, [0.5] * 3, resample=2),
        "do_pan_and_scan": False,
    }
    processor = {"processor_class": "Gemma3Processor", "image_seq_length": text["mm_tokens_per_image"]}
    _write_configs(path, config, image, processor)
    return path, config, image, processor


def build_qwen3_vl(path: Path | str, *, seed: int = 0) -> Path:
    """A tiny Qwen3-VL: 3 text layers, deepstack features from vision blocks 0 and 1 added to text layers 0 and
    1; images of 64 to 128 pixels a side (multiples of 32): 4 to 16 image tokens. Qwen2-VL's tokenizer files."""
    from tests.tiny_vlm import _write_tokenizer

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    ids = _write_tokenizer(path, 384, 1024, None)
    text = {
        **TEXT,
        "num_hidden_layers": 3,
        "model_type": "qwen3_vl_text",
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "vocab_size": ids["vocab"],
        "rope_theta": 10000.0,
        "max_position_embeddings": 1024,
        "rope_scaling": {"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True},
        "tie_word_embeddings": False,
    }
    config = {
        "model_type": "qwen3_vl",
        "architectures": ["Qwen3VLForConditionalGeneration"],
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "eos_token_id": ids["<|im_end|>"],
        "tie_word_embeddings": False,
        "text_config": text,
        "vision_config": {
            **VISION,
            "model_type": "qwen3_vl",
            "depth": 3,
            "num_heads": 2,
            "out_hidden_size": TEXT["hidden_size"],
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "num_position_embeddings": 64,
            "deepstack_visual_indexes": [0, 1],
            "in_channels": 3,
        },
    }
    image = {
        "image_processor_type": "Qwen3VLImageProcessor",
        "patch_size": 16,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "min_pixels": 64 * 64,
        "max_pixels": 128 * 128,
        **_pixels([0.5] * 3, [0.5] * 3, resample=3),
    }
    (path / "video_preprocessor_config.json").write_text(json.dumps(image, indent=1))
    return _finish(path, config, image, {"processor_class": "Qwen3VLProcessor"}, seed)


BUILDERS = {"llava": build_llava, "gemma3": build_gemma3, "qwen3_vl": build_qwen3_vl}


def _pixels(mean: list[float], std: list[float], *, resample: int) -> dict[str, Any]:
    return {
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": mean,
        "image_std": std,
        "do_convert_rgb": True,
        "resample": resample,
    }


def _finish(path: Path, config: dict[str, Any], image: dict[str, Any], processor: dict[str, Any], seed: int) -> Path:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    _write_configs(path, config, image, processor)
    model = random_model(config, seed=seed)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    return path


def _write_configs(path: Path, config: dict[str, Any], image: dict[str, Any], processor: dict[str, Any]) -> None:
    (path / "config.json").write_text(json.dumps(config, indent=1))
    (path / "preprocessor_config.json").write_text(json.dumps(image, indent=1))
    (path / "processor_config.json").write_text(json.dumps(processor, indent=1))


def random_model(config: dict[str, Any], *, seed: int = 0, dtype: str | None = None) -> Any:
    """mlx-vlm's Model for `config` with random weights, built as mlx-vlm's loader builds it."""
    import importlib

    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_vlm.utils import update_module_configs

    family = importlib.import_module(f"mlx_vlm.models.{config['model_type']}")
    mx.random.seed(seed)
    cfg = json.loads(json.dumps(config))
    model_config = family.ModelConfig.from_dict(cfg)
    model_config = update_module_configs(model_config, family, cfg, ["text", "vision", "perceiver", "projector"])
    model = family.Model(model_config)
    if dtype is not None:
        from tests.tiny_vlm import _fresh

        dt = getattr(mx, dtype)
        model.update(tree_unflatten([(k, _fresh(k, a, dt)) for k, a in tree_flatten(model.parameters())]))
    _sharpen(model, config)
    for _, a in tree_flatten(model.parameters()):
        mx.eval(a)
    model.eval()
    return model


def _sharpen(model: Any, config: dict[str, Any]) -> None:
    """Logits with a std of about 2, sharper attention, image features on the text embeddings' scale."""
    import mlx.core as mx

    lm = model.language_model
    hidden = config["text_config"]["hidden_size"]
    dt = lm.model.embed_tokens.weight.dtype
    # Gemma 3 multiplies input embeddings by sqrt(hidden): its table is drawn that much smaller, so that the
    # layers' outputs (normalized, RMS about 2) are not drowned by the current token's embedding.
    embed_scale = 1.0 / hidden**0.5 if config["model_type"] == "gemma3" else 1.0
    lm.model.embed_tokens.weight = mx.random.normal(lm.model.embed_tokens.weight.shape, dtype=dt) * embed_scale
    if getattr(lm, "lm_head", None) is not None:
        lm.lm_head.weight = mx.random.normal(lm.lm_head.weight.shape, dtype=dt) * (2.0 / hidden**0.5)
    for layer in lm.model.layers:
        attn = layer.self_attn
        attn.q_proj.weight = attn.q_proj.weight * 6.0
        attn.k_proj.weight = attn.k_proj.weight * 6.0
        if config["model_type"] == "qwen3_vl":  # q and k are RMS-normed per head: sharpen after the norms
            attn.q_norm.weight = attn.q_norm.weight * 3.0
            attn.k_norm.weight = attn.k_norm.weight * 3.0
    if config["model_type"] == "qwen3_vl":  # the merger and each deepstack merger: features that matter
        for merger in [model.vision_tower.merger, *model.vision_tower.deepstack_merger_list]:
            last = merger.linear_fc2
            last.weight = mx.random.normal(last.weight.shape, dtype=dt) * (4.0 / last.weight.shape[1] ** 0.5)
        return
    proj = model.multi_modal_projector
    if config["model_type"] in ("llava", "llava_next", "mistral3", "pixtral"):  # a two-layer MLP projector
        last = proj.linear_2
        last.weight = mx.random.normal(last.weight.shape, dtype=dt) * (4.0 / last.weight.shape[1] ** 0.5)
    else:  # gemma3: the projection is mx.ones at init (every output alike); features go in / sqrt(hidden)
        w = proj.mm_input_projection_weight
        scale = float(model.config.hidden_size) ** 0.5 / (2.0 * w.shape[0] ** 0.5) * embed_scale
        proj.mm_input_projection_weight = mx.random.normal(w.shape, dtype=dt) * scale


def _tokenizer(
    path: Path,
    specials: list[str],
    eos: str,
    template: str,
    extra: dict[str, str],
    *,
    pad: str | None = None,
    vocab_size: int = 384,
    model_vocab: int | None = None,
) -> dict[str, int]:
    """A trained BPE tokenizer; `model_vocab` pads its vocabulary with unreachable tokens up to a real model's
    size, so that the model may emit any id and every id still decodes."""
    from tests.tiny_model import train_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(path, vocab_size, specials, _CORPUS)
    real = tokenizer.get_vocab_size()
    if model_vocab and model_vocab > real:
        data = json.loads((path / "tokenizer.json").read_text())
        data["model"]["vocab"].update({f"pad{i}": i for i in range(real, model_vocab)})
        (path / "tokenizer.json").write_text(json.dumps(data))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": eos,
        "pad_token": pad or eos,
        "unk_token": None,
        "model_max_length": 1024,
        "chat_template": template,  # the tokenizer's only: mlx-vlm's processors for these families keep none
        "add_prefix_space": False,
        "extra_special_tokens": extra,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "special_tokens_map.json").write_text(json.dumps({"eos_token": eos, "pad_token": pad or eos}))
    ids = {t: tokenizer.token_to_id(t) for t in specials}
    ids["vocab"] = max(real, model_vocab or 0)
    return ids
