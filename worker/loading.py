"""A --model string -> the loaded model, and the engine that runs it (text, batched vision, serial vision).

`load_engine` is what `omlx-jobs worker` and `omlx-jobs run` call: the model is loaded once per worker, with
mlx-lm for a text model and with mlx-vlm for a vision model (its config says so), and the families that cannot
batch run one request at a time (vision/serial.py).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

from omlx_jobs.jobs.images import ImageAccess
from omlx_jobs.worker.embeddings.encoder import is_encoder, load_encoder
from omlx_jobs.worker.embeddings.engine import EmbeddingEngine
from omlx_jobs.worker.embeddings.model import EmbeddingModel, load_decoder
from omlx_jobs.worker.embeddings.pooling import is_embedding_model
from omlx_jobs.worker.engine.config import EngineConfig
from omlx_jobs.worker.engine.limits import silence_tokenizer_length_warning
from omlx_jobs.worker.engine.loop import Engine
from omlx_jobs.worker.models.loaded import LoadedModel, load_text
from omlx_jobs.worker.models.paths import ModelLoadError, resolve_model_path
from omlx_jobs.worker.vision.loaded import load_vision
from omlx_jobs.worker.vision.model import vision_model_type
from omlx_jobs.worker.vision.serial import SerialEngine


def load(
    ref: str, *, context_length: int | None = None, cache_root: Path | None = None, images: ImageAccess | None = None
) -> LoadedModel:
    """Load weights and tokenizer once per worker: a text model with mlx_lm.load, a vision model (its config says
    so) with mlx-vlm, reading images only as `images` (an ImageAccess: this worker's allowed folders) allows."""
    path = resolve_model_path(ref, cache_root=cache_root)
    if is_embedding_model(path):  # a sentence-transformers model (it has a Pooling module): embeddings only
        return load_embedding(ref, path, context_length=context_length)
    if is_vision(path):
        return load_vision(ref, path, context_length=context_length, images=images)
    return load_text(ref, path, context_length=context_length)


def load_embedding(ref: str, path: Path, *, context_length: int | None = None) -> EmbeddingModel:
    """An embedding model: an encoder family (BERT, XLM-RoBERTa, ModernBERT) through mlx-embeddings, any other
    (a decoder: Qwen3-Embedding, gte-Qwen, e5-mistral) through mlx-lm."""
    config = _config(path)
    if is_encoder(config):
        return load_encoder(ref, path, config, context_length=context_length)
    return load_decoder(ref, path, context_length=context_length)


def _config(path: Path) -> dict[str, Any]:
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def is_vision(path: Path) -> bool:
    """Whether the model directory holds a vision-language model mlx-vlm can load (ModelLoadError if it is one but
    mlx-vlm is not installed)."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    if isinstance(config.get("vision_config"), dict) and importlib.util.find_spec("mlx_vlm") is None:
        raise ModelLoadError(f"{path} is a vision model: pip install 'omlx-jobs[vision]' (mlx-vlm) to run it")
    return vision_model_type(config) is not None


def engine_for(loaded: LoadedModel, config: EngineConfig | None = None) -> Engine | SerialEngine | EmbeddingEngine:
    """The engine that runs this model: the embedding engine for an embedding model, the batching Engine, or the
    serial one for a vision family that cannot batch (vision.model.BATCHED)."""
    if isinstance(loaded, EmbeddingModel):
        return EmbeddingEngine(loaded, config)
    if loaded.vision is not None and not loaded.vision.batched:
        return SerialEngine(loaded, config)
    return Engine(loaded, config)


def load_engine(
    model: str,
    config: EngineConfig | None = None,
    *,
    context_length: int | None = None,
    images: ImageAccess | None = None,
) -> Engine | SerialEngine | EmbeddingEngine:
    """Load the model a --model string names and return the engine that runs it."""
    silence_tokenizer_length_warning()  # the engines check every prompt's length themselves (engine/limits.py)
    return engine_for(load(model, context_length=context_length, images=images), config)
