"""A tiny random decoder embedding model: the tiny qwen3 of tiny_model.py plus sentence-transformers' files
(modules.json, 1_Pooling/config.json, config_sentence_transformers.json), written as a test asks."""

from __future__ import annotations

import json
from pathlib import Path

from tests.tiny_model import build_tiny_model

MODES = {"lasttoken": "pooling_mode_lasttoken", "mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token"}


def write_sentence_transformers(
    path: Path,
    *,
    pooling: str = "lasttoken",
    normalize: bool = True,
    prefix: str = "",
    matryoshka: bool = True,
    include_prompt: bool = True,
) -> Path:
    """The sentence-transformers files of an embedding model in `path`, declaring `pooling` and the rest."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    config = {"word_embedding_dimension": 64, **{key: name == pooling for name, key in MODES.items()}}
    config["include_prompt"] = include_prompt
    (path / "1_Pooling" / "config.json").write_text(json.dumps(config))
    st = {"prompts": {"query": prefix, "document": ""}, "default_prompt_name": "query" if prefix else None}
    if matryoshka:
        st["matryoshka_dims"] = [64, 32, 16]
    (path / "config_sentence_transformers.json").write_text(json.dumps(st))
    return path


def build_tiny_embedding(path: Path | str, *, context_length: int = 512, **kw: object) -> Path:
    """A tiny random qwen3 in `path` with the sentence-transformers files of write_sentence_transformers(**kw)."""
    path = build_tiny_model(path, context_length=context_length)
    return write_sentence_transformers(path, **kw)  # type: ignore[arg-type]


BERT_SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def build_tiny_bert(path: Path | str, *, pooling: str = "mean", hidden_size: int = 64, seed: int = 0) -> Path:
    """A tiny random BERT that mlx-embeddings loads: config.json, model.safetensors, a tokenizer adding [CLS] and
    [SEP] (a BPE one of tiny_model's, so no vocabulary file is needed), and sentence-transformers' files."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_embeddings.models import bert
    from tokenizers import processors

    from tests.tiny_model import _CORPUS, train_tokenizer

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(path, 384, BERT_SPECIAL, _CORPUS)
    cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
    )
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "pad_token": "[PAD]",
                "cls_token": "[CLS]",
                "sep_token": "[SEP]",
                "unk_token": "[UNK]",
                "model_max_length": 128,
            }
        )
    )
    config = {
        "model_type": "bert",
        "architectures": ["BertModel"],
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "max_position_embeddings": 128,
        "vocab_size": tokenizer.get_vocab_size(),
        "type_vocab_size": 2,
        "layer_norm_eps": 1e-12,
        "pad_token_id": 0,
    }
    (path / "config.json").write_text(json.dumps(config))
    mx.random.seed(seed)
    args = {k: v for k, v in config.items() if k not in ("architectures", "pad_token_id")}
    model = bert.Model(bert.ModelArgs(**args))
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    return write_sentence_transformers(path, pooling=pooling, matryoshka=False)
