"""A tiny random decoder embedding model: the tiny qwen3 of tiny_model.py plus sentence-transformers' files
(modules.json, 1_Pooling/config.json, config_sentence_transformers.json), written as a test asks."""

from __future__ import annotations

import json
from pathlib import Path

from tests.tiny_model import build_tiny_model

MODES = {"lasttoken": "pooling_mode_lasttoken", "mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token"}


def write_sentence_transformers(
    path: Path, *, pooling: str = "lasttoken", normalize: bool = True, prefix: str = "", matryoshka: bool = True
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
