"""How an embedding model turns hidden states into one vector, from its own files (sentence-transformers'):
`modules.json` names the Pooling module's folder, whose `config.json` says last token, mean or CLS; a
`Normalize` module says unit length; `config_sentence_transformers.json` holds the instruction prompts (the one
named `default_prompt_name` is prefixed to every input). Pure: json only, no MLX.

Whether a model declares Matryoshka dimensions (`dimensions` may truncate it) is jobs/embeddings.py's
`declares_matryoshka`: submit checks it too, when --model is a local directory.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omlx_jobs.jobs.embeddings import declares_matryoshka

POOLING_MODULE = "sentence_transformers.models.Pooling"
NORMALIZE_MODULE = "sentence_transformers.models.Normalize"
POOLINGS = ("lasttoken", "mean", "cls")
_MODE_KEYS = {
    "lasttoken": "pooling_mode_lasttoken",
    "mean": "pooling_mode_mean_tokens",
    "cls": "pooling_mode_cls_token",
}


class PoolingConfigError(ValueError):
    """The model's sentence-transformers files say something this runner cannot do."""


@dataclass(frozen=True)
class EmbeddingConfig:
    """What an embedding model's files say about its vectors."""

    pooling: str = "lasttoken"
    """One of POOLINGS."""
    normalize: bool = True
    prefix: str = ""
    """The instruction prompt prefixed to every text input (token-id inputs are taken as given)."""
    matryoshka: bool = False
    """Whether `dimensions` may truncate the vectors (then renormalized)."""
    include_prompt: bool = True
    """Pooling's `include_prompt`: False leaves the instruction prompt's positions out of a mean."""


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def pooling_folder(path: Path) -> Path | None:
    """The folder of the model's Pooling module (modules.json), or None: not a sentence-transformers model."""
    modules = _read_json(path / "modules.json")
    if not isinstance(modules, list):
        return None
    for module in modules:
        if isinstance(module, dict) and module.get("type") == POOLING_MODULE:
            return path / str(module.get("path", ""))
    return None


def is_embedding_model(path: Path) -> bool:
    """Whether the model directory is a sentence-transformers embedding model (it has a Pooling module)."""
    return pooling_folder(path) is not None


def read_config(path: Path) -> EmbeddingConfig:
    """The model's EmbeddingConfig (PoolingConfigError for a pooling we do not run, e.g. weighted mean)."""
    folder = pooling_folder(path)
    if folder is None:
        raise PoolingConfigError(f"{path} has no sentence-transformers Pooling module in modules.json")
    pooling = _read_json(folder / "config.json") or {}
    modes = [name for name, key in _MODE_KEYS.items() if pooling.get(key)]
    other = [k for k, v in pooling.items() if k.startswith("pooling_mode_") and v and k not in _MODE_KEYS.values()]
    if other or len(modes) > 1:
        raise PoolingConfigError(f"{folder}/config.json asks for {other or modes}; one of {POOLINGS} is supported")
    modules = _read_json(path / "modules.json") or []
    normalize = any(isinstance(m, dict) and m.get("type") == NORMALIZE_MODULE for m in modules)
    st = _read_json(path / "config_sentence_transformers.json") or {}
    prompts = st.get("prompts") if isinstance(st.get("prompts"), dict) else {}
    prefix = prompts.get(st.get("default_prompt_name") or "", "") or ""
    return EmbeddingConfig(
        pooling=modes[0] if modes else "mean",  # sentence-transformers' own default
        normalize=normalize,
        prefix=str(prefix),
        matryoshka=declares_matryoshka(path),
        include_prompt=bool(pooling.get("include_prompt", True)),
    )
