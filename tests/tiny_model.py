"""Build a tiny random-weight qwen3 model with a locally trained BPE tokenizer.

`mlx_lm.load` accepts the directory. It takes well under a second and needs no network.
Random weights produce junk text, so tests compare token ids between code paths.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "You are a helpful assistant. Answer briefly and clearly.",
    "What is the capital of France? Paris is the capital of France.",
    "Summarize the following text in one sentence.",
    "Translate to German: good morning, good night, thank you.",
    "system user assistant question answer number letter word",
    "0123456789 + - * / = ( ) [ ] { } , . ; : ! ? ' \" # @",
    "Once upon a time there was a little model that generated tokens.",
    "Extract the names, dates and places from this document.",
]


def train_tokenizer(path: Path, vocab_size: int, special_tokens: list[str], corpus: list[str]) -> Any:
    """A byte-level BPE tokenizer trained on `corpus`, saved as path/tokenizer.json (tiny_vlm.py uses it too)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus * 4, trainer=trainer)
    tokenizer.save(str(path / "tokenizer.json"))
    return tokenizer


def build_tiny_model(
    path: Path | str,
    *,
    vocab_size: int = 384,
    hidden_size: int = 64,
    num_layers: int = 2,
    context_length: int = 512,
    seed: int = 0,
    vocab_padding: int = 0,
    chat_template: str = CHATML_TEMPLATE,
    special_tokens: tuple[str, ...] = (),
    added_tokens: tuple[str, ...] = (),
    eos_token: str = "<|im_end|>",
) -> Path:
    """Write config.json, model.safetensors and a tokenizer into `path`; return it.

    `vocab_padding` adds logits past the tokenizer's vocabulary, as many real models have (rounded-up sizes).
    `special_tokens` are added to the default ones; `added_tokens` are one token each but not special (as
    Qwen3's `<think>` and `<tool_call>`), so a grammar can spell them.
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen3

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)

    tokenizer = train_tokenizer(path, vocab_size, [*SPECIAL_TOKENS, *special_tokens], _CORPUS)
    if added_tokens:
        from tokenizers import AddedToken

        tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in added_tokens])
        tokenizer.save(str(path / "tokenizer.json"))
    real_vocab = tokenizer.get_vocab_size()
    eos_id = tokenizer.token_to_id(eos_token)

    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": None,
                "eos_token": eos_token,
                "pad_token": "<|endoftext|>",
                "unk_token": None,
                "model_max_length": context_length,
                "chat_template": chat_template,
                "add_prefix_space": False,
            }
        )
    )
    (path / "special_tokens_map.json").write_text(json.dumps({"eos_token": eos_token, "pad_token": "<|endoftext|>"}))

    config = {
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "intermediate_size": hidden_size * 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": hidden_size // 4,
        "rms_norm_eps": 1e-6,
        "vocab_size": real_vocab + vocab_padding,
        "max_position_embeddings": context_length,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "eos_token_id": eos_id,
        "torch_dtype": "float32",
    }
    (path / "config.json").write_text(json.dumps(config, indent=1))

    mx.random.seed(seed)
    model = qwen3.Model(qwen3.ModelArgs(**{k: v for k, v in config.items() if k in _ARG_KEYS}))
    # Logits with a std of about 2: greedy picks depend on the context and sampling is not near-uniform.
    model.model.embed_tokens.weight = mx.random.normal(model.model.embed_tokens.weight.shape)
    model.lm_head.weight = mx.random.normal(model.lm_head.weight.shape) * (2.0 / hidden_size**0.5)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    return path


_ARG_KEYS = {
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "intermediate_size",
    "num_attention_heads",
    "rms_norm_eps",
    "vocab_size",
    "num_key_value_heads",
    "max_position_embeddings",
    "head_dim",
    "tie_word_embeddings",
    "rope_theta",
}
