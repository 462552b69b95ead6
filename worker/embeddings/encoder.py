"""Encoder embedding models (BERT, XLM-RoBERTa, ModernBERT) through mlx-embeddings' model classes: the
`embeddings` extra. Their attention is bidirectional, so each batch gets its padding mask, and no prefix is ever
reused across inputs (a shared start computes differently beside different ends).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx

from omlx_jobs.worker.embeddings.model import EmbeddingModel
from omlx_jobs.worker.embeddings.pooling import read_config
from omlx_jobs.worker.models.paths import ModelLoadError, model_identity

ENCODER_TYPES = frozenset({"bert", "xlm-roberta", "xlm_roberta", "modernbert"})
"""config.json model_types that load through mlx-embeddings (decoders load through mlx-lm)."""


def is_encoder(config: dict[str, Any]) -> bool:
    return str(config.get("model_type", "")).lower() in ENCODER_TYPES


def load_encoder(
    ref: str, path: Path, model_config: dict[str, Any], *, context_length: int | None = None
) -> EmbeddingModel:
    """An encoder embedding model through mlx_embeddings.load (ModelLoadError without the extra)."""
    try:
        from mlx_embeddings.utils import load  # mlx-embeddings is optional (the [embeddings] extra)
    except ImportError as exc:
        raise ModelLoadError(
            f"{path} is an encoder embedding model ({model_config.get('model_type')}): pip install "
            "'omlx-jobs[embeddings]' (mlx-embeddings) to run it"
        ) from exc
    try:
        model, tokenizer = load(str(path))
    except Exception as exc:
        raise ModelLoadError(f"mlx-embeddings could not load {path}: {exc}") from exc

    def forward(ids: mx.array, mask: mx.array) -> mx.array:
        return model(ids, attention_mask=mask.astype(mx.float32)).last_hidden_state

    # Learned positions bound the context: an input past them has no position embedding.
    limit = int(model_config.get("max_position_embeddings") or 512)
    return EmbeddingModel(
        ref=ref,
        path=path,
        model=model,
        tokenizer=getattr(tokenizer, "_tokenizer", tokenizer),
        config=model_config,
        identity=model_identity(path),
        context_length=min(context_length or limit, limit),
        embedding=read_config(path),
        forward=forward,
        causal=False,
        dim=int(model_config["hidden_size"]),
    )
