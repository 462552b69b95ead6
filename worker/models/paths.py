"""Where a --model string points: a local model directory, a GGUF file converted once, or a Hub id already cached;
and what the directory says about the model (its identity, its context length)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from huggingface_hub import snapshot_download

from omlx_jobs.errors import OmlxError
from omlx_jobs.worker.models.gguf import cached_conversion

GGUF_PREFIX = "gguf:"


class ModelLoadError(OmlxError, RuntimeError):
    """The model cannot be found or loaded; the message says what to pass instead."""


def model_identity(path: Path) -> str:
    """A stable id of the weights and tokenizer: caches are keyed by it and never cross models."""
    h = hashlib.sha256()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        f = path / name
        if f.exists():
            h.update(name.encode())
            h.update(f.read_bytes())
    for f in sorted(path.glob("*.safetensors")):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
    return h.hexdigest()[:32]


def resolve_model_path(ref: str, *, cache_root: Path | None = None) -> Path:
    """A local directory for `ref`: a path, `gguf:FILE` (converted once, cached), or a Hub id already cached."""
    if ref.startswith(GGUF_PREFIX):
        return cached_conversion(Path(ref[len(GGUF_PREFIX) :]).expanduser(), cache_root=cache_root)
    path = Path(ref).expanduser()
    if path.exists():
        if not (path / "config.json").exists():
            raise ModelLoadError(f"{path} has no config.json: it is not an MLX / Hugging Face model directory")
        return path
    try:
        return Path(snapshot_download(ref, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]))
    except Exception as exc:
        raise ModelLoadError(
            f"model {ref!r} is not a local directory and could not be fetched from the Hugging Face Hub ({exc}). "
            "Pass a local MLX model directory, or gguf:FILE.gguf"
        ) from exc


def context_length_of(config: dict[str, Any], path: Path) -> int:
    for key in ("max_position_embeddings", "max_sequence_length", "seq_length", "n_positions", "n_ctx"):
        value = config.get(key) or (config.get("text_config") or {}).get(key)
        if isinstance(value, int) and value > 0:
            return value
    tc = path / "tokenizer_config.json"
    if tc.exists():
        value = json.loads(tc.read_text()).get("model_max_length")
        if isinstance(value, int) and 0 < value < 10**7:
            return value
    return 4096
