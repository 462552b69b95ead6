"""Build a tiny random-weight Qwen2-VL model (mlx-vlm's `qwen2_vl`) with a locally trained BPE tokenizer.

Why qwen2_vl: its image processor is mlx-vlm's own numpy port (no torch, no transformers image classes), its
processor needs only small JSON files, and its vision tower is a handful of plain layers. It also has mRoPE
(3-D positions on the model), which is exactly where batched decoding goes wrong, so one fixture covers the
hard case. Both `mlx_vlm.load` and mlx-lm's text-only `qwen2_vl` model accept the directory.

Random weights produce junk text, so tests compare token ids between code paths. No network, no torch; it
builds in well under a second.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Qwen2-VL's chat template, shortened: image parts become <|vision_start|><|image_pad|><|vision_end|>, which
# the processor expands to one <|image_pad|> per image token.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

PATCH = 14
MERGE = 2
# Image sizes are snapped to multiples of 28 and kept between these pixel counts: 4 to 16 image tokens.
MIN_PIXELS = 56 * 56
MAX_PIXELS = 112 * 112

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "You are a helpful assistant. Answer briefly and clearly.",
    "Describe this image. What color is the square? How many objects are there?",
    "Read the text in the picture and extract the names, dates and places.",
    "user assistant system question answer number letter word picture photo",
    "0123456789 + - * / = ( ) [ ] { } , . ; : ! ? ' \" # @",
]


TINY_SHAPE: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vision_dim": 32,
    "vision_depth": 2,
    "vision_heads": 2,
    "vision_mlp_ratio": 2,
}


def build_tiny_vlm(
    path: Path | str,
    *,
    vocab_size: int = 384,
    context_length: int = 1024,
    seed: int = 0,
    attention_scale: float = 6.0,
    shape: dict[str, Any] | None = None,
    min_pixels: int = MIN_PIXELS,
    max_pixels: int = MAX_PIXELS,
    model_type: str = "qwen2_vl",
) -> Path:
    """Write config, weights, tokenizer and processor files of a tiny qwen2_vl (or qwen2_5_vl) model; return it."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    config = write_vlm_files(
        path,
        vocab_size=vocab_size,
        context_length=context_length,
        shape=shape,
        min_pixels=min_pixels,
        max_pixels=max_pixels,
        model_type=model_type,
    )
    model = random_vlm(config, seed=seed, attention_scale=attention_scale)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(Path(path) / "model.safetensors"), weights, metadata={"format": "mlx"})
    return Path(path)


def write_vlm_files(
    path: Path | str,
    *,
    vocab_size: int = 384,
    model_vocab: int | None = None,
    context_length: int = 1024,
    shape: dict[str, Any] | None = None,
    min_pixels: int = MIN_PIXELS,
    max_pixels: int = MAX_PIXELS,
    model_type: str = "qwen2_vl",
) -> dict[str, Any]:
    """Write config.json, tokenizer and processor files (no weights); return the config.

    `model_type` is qwen2_vl or qwen2_5_vl (the same language model; 2.5's vision tower has windowed attention).

    `model_vocab` pads the tokenizer's vocabulary with unreachable tokens up to a real model's size, so the
    model may emit any id and every id still decodes.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    ids = _write_tokenizer(path, vocab_size, context_length, model_vocab)
    s = {**TINY_SHAPE, **(shape or {})}
    head_dim = s["hidden_size"] // s["num_attention_heads"]
    config = {
        "model_type": model_type,
        "architectures": [ARCHITECTURES[model_type]],
        "hidden_size": s["hidden_size"],
        "num_hidden_layers": s["num_hidden_layers"],
        "intermediate_size": s["intermediate_size"],
        "num_attention_heads": s["num_attention_heads"],
        "num_key_value_heads": s["num_key_value_heads"],
        "rms_norm_eps": 1e-6,
        "vocab_size": ids["vocab"],
        "max_position_embeddings": context_length,
        "rope_theta": 10000.0,
        # mRoPE: the rotary frequencies split into (temporal, height, width) sections; they sum to head_dim / 2.
        "rope_scaling": {"type": "mrope", "mrope_section": _sections(head_dim // 2)},
        "tie_word_embeddings": False,
        "eos_token_id": ids["<|im_end|>"],
        "bos_token_id": None,
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "torch_dtype": "float32",
        "vision_config": _vision_config(model_type, s),
    }
    (path / "config.json").write_text(json.dumps(config, indent=1))
    _write_processor_files(path, min_pixels, max_pixels, PROCESSORS[model_type])
    return config


ARCHITECTURES = {"qwen2_vl": "Qwen2VLForConditionalGeneration", "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration"}
PROCESSORS = {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor"}


def _vision_config(model_type: str, s: dict[str, Any]) -> dict[str, Any]:
    common = {
        "model_type": model_type,
        "depth": s["vision_depth"],
        "num_heads": s["vision_heads"],
        "patch_size": PATCH,
        "spatial_patch_size": PATCH,
        "spatial_merge_size": MERGE,
        "temporal_patch_size": 2,
        "in_channels": 3,
    }
    if model_type == "qwen2_vl":
        return {
            **common,
            "embed_dim": s["vision_dim"],
            "hidden_size": s["hidden_size"],
            "mlp_ratio": s["vision_mlp_ratio"],
        }
    return {  # qwen2_5_vl: windows of 2 x 2 merged patches, the last block attends fully
        **common,
        "hidden_size": s["vision_dim"],
        "intermediate_size": s["vision_dim"] * s["vision_mlp_ratio"],
        "out_hidden_size": s["hidden_size"],
        "window_size": PATCH * MERGE * 2,
        "fullatt_block_indexes": [s["vision_depth"] - 1],
        "tokens_per_second": 2,
    }


def random_vlm(config: dict[str, Any], *, seed: int = 0, attention_scale: float = 6.0, dtype: str | None = None) -> Any:
    """An mlx-vlm Model (qwen2_vl or qwen2_5_vl) with random weights for `config`, in memory."""
    import importlib

    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    family = importlib.import_module(f"mlx_vlm.models.{config['model_type']}")
    mx.random.seed(seed)
    model_config = family.ModelConfig.from_dict(dict(config))
    model_config.text_config = family.TextConfig.from_dict(config)
    model_config.vision_config = family.VisionConfig.from_dict(config["vision_config"])
    model = family.Model(model_config)
    if dtype is not None:  # fresh arrays in `dtype`: the float32 ones the layers made are never computed
        dt = getattr(mx, dtype)
        model.update(tree_unflatten([(k, _fresh(k, a, dt)) for k, a in tree_flatten(model.parameters())]))
    lm = model.language_model
    hidden = config["hidden_size"]
    dt = lm.model.embed_tokens.weight.dtype
    # Logits with a std of about 2 (greedy picks depend on the context); image features on the embeddings' scale.
    lm.model.embed_tokens.weight = mx.random.normal(lm.model.embed_tokens.weight.shape, dtype=dt)
    lm.lm_head.weight = mx.random.normal(lm.lm_head.weight.shape, dtype=dt) * (2.0 / hidden**0.5)
    for layer in lm.model.layers:  # sharper attention: outputs depend on which image and text came before
        attn = layer.self_attn
        attn.q_proj.weight = attn.q_proj.weight * attention_scale
        attn.k_proj.weight = attn.k_proj.weight * attention_scale
    last = model.vision_tower.merger.mlp[-1]
    last.weight = mx.random.normal(last.weight.shape, dtype=dt) * (4.0 / last.weight.shape[1] ** 0.5)
    for _, a in tree_flatten(model.parameters()):  # one at a time: the peak is the weights, not a graph of them
        mx.eval(a)
    model.eval()
    return model


def _fresh(name: str, a: Any, dtype: Any) -> Any:
    """A random parameter like nn.Linear's default init (uniform in +-1/sqrt(fan_in)); norms 1, biases 0."""
    import math

    import mlx.core as mx

    if a.ndim >= 2:
        bound = 1.0 / math.sqrt(math.prod(a.shape[1:]))
        return mx.random.uniform(-bound, bound, a.shape, dtype=dtype)
    return mx.zeros(a.shape, dtype=dtype) if name.endswith("bias") else mx.ones(a.shape, dtype=dtype)


def _sections(half: int) -> list[int]:
    t = half // 4
    h = (half - t) // 2
    return [t, h, half - t - h]


def _write_tokenizer(path: Path, vocab_size: int, context_length: int, model_vocab: int | None) -> dict[str, int]:
    from tests.tiny_model import train_tokenizer

    tokenizer = train_tokenizer(path, vocab_size, SPECIAL_TOKENS, _CORPUS)
    real = tokenizer.get_vocab_size()
    if model_vocab and model_vocab > real:
        data = json.loads((path / "tokenizer.json").read_text())
        data["model"]["vocab"].update({f"pad{i}": i for i in range(real, model_vocab)})
        (path / "tokenizer.json").write_text(json.dumps(data))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "unk_token": None,
                "model_max_length": context_length,
                "chat_template": CHAT_TEMPLATE,
                "add_prefix_space": False,
                "extra_special_tokens": {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"},
            }
        )
    )
    (path / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}))
    (path / "chat_template.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    ids = {t: tokenizer.token_to_id(t) for t in SPECIAL_TOKENS}
    ids["vocab"] = max(real, model_vocab or 0)
    return ids


def _write_processor_files(path: Path, min_pixels: int, max_pixels: int, processor: str) -> None:
    # Every file the processor looks for exists locally, so nothing falls back to the Hub.
    image = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "patch_size": PATCH,
        "temporal_patch_size": 2,
        "merge_size": MERGE,
        "min_pixels": min_pixels,
        "max_pixels": max_pixels,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "do_convert_rgb": True,
    }
    (path / "preprocessor_config.json").write_text(json.dumps(image, indent=1))
    (path / "video_preprocessor_config.json").write_text(json.dumps(image, indent=1))
    (path / "processor_config.json").write_text(json.dumps({"processor_class": processor}))
