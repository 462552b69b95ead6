"""An embedding model loaded once: its forward pass to hidden states, its pooling config, and its inputs.

A decoder (Qwen3-Embedding, gte-Qwen, e5-mistral) loads with mlx_lm.load, and its forward pass is the model's
`.model` call: the hidden states after the final norm, before lm_head. An encoder (BERT, XLM-RoBERTa, ...) loads
with mlx-embeddings (the `embeddings` extra: encoder.py). Every input item is tokenized here, with the model's
instruction prefix, and checked against the context; `dimensions` against what the model declares.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
from mlx_lm.models.cache import KVCache, make_prompt_cache

from omlx_jobs.errors import ErrorCode
from omlx_jobs.jobs.embeddings import EMBEDDINGS_URL
from omlx_jobs.worker.embeddings.pooling import EmbeddingConfig, read_config
from omlx_jobs.worker.embeddings.reuse import Extend, NewCache
from omlx_jobs.worker.embeddings.runner import Forward
from omlx_jobs.worker.models.loaded import LoadedModel
from omlx_jobs.worker.models.paths import ModelLoadError, context_length_of, model_identity
from omlx_jobs.worker.prompts import Prompt, PromptError, token_key


@dataclass(frozen=True, eq=False)
class EmbeddingPrompt(Prompt):
    """An embeddings request as the engine runs it: `tokens` is every item's ids one after another (its key and
    accounting); `items` holds them one per input item."""

    items: tuple[tuple[int, ...], ...] = ()
    dimensions: int | None = None
    base64: bool = False
    starts: tuple[int, ...] = ()
    """Per item, its leading positions a mean leaves out (the instruction prompt, where the model's pooling
    excludes it); empty: none."""


@dataclass
class EmbeddingModel(LoadedModel):
    """A LoadedModel whose requests are embeddings (see the module docstring)."""

    embedding: EmbeddingConfig = field(default_factory=EmbeddingConfig)
    forward: Forward | None = None
    causal: bool = True
    """A decoder's attention is causal (a shared prefix is exact to reuse); an encoder's is bidirectional."""
    dim: int = 0
    extend: Extend | None = None
    """A causal model's forward pass from KV caches (reuse.py), or None: no prefix reuse."""
    new_cache: NewCache | None = None

    def prompt(self, endpoint: str, body: dict[str, Any]) -> Prompt:
        """The request's items, tokenized and checked (PromptError names the item that cannot run)."""
        if endpoint != EMBEDDINGS_URL:
            raise PromptError(
                ErrorCode.EMBEDDING_MODEL_ONLY,
                f"{self.ref} is an embedding model: it takes {EMBEDDINGS_URL} requests only; send {endpoint} "
                "requests to a worker of a generation model",
            )
        dims = body.get("dimensions")
        if dims is not None:
            self._check_dimensions(int(dims))
        items = tuple(tuple(self._item(item, i)) for i, item in enumerate(body["input"]))
        flat = [t for item in items for t in item]
        skip = self._prompt_positions()
        starts = tuple(skip if isinstance(item, str) else 0 for item in body["input"]) if skip else ()
        base64 = body.get("encoding_format") == "base64"
        return EmbeddingPrompt(flat, token_key(flat), (), items, dims, base64, starts)

    def _prompt_positions(self) -> int:
        """Positions of the instruction prompt that a mean leaves out: sentence-transformers' prompt_length (the
        prompt's token count less one, for the special token its tokenizer appends) when include_prompt is off."""
        if self.embedding.include_prompt or not self.embedding.prefix:
            return 0
        return max(len(self.tokenizer.encode(self.embedding.prefix)) - 1, 0)

    def _item(self, item: str | list[int], i: int) -> list[int]:
        if isinstance(item, list):
            vocab = self.vocab_size
            bad = [t for t in item if t >= vocab]
            if bad:
                raise PromptError(ErrorCode.INVALID_PROMPT, f"input[{i}]: token id {bad[0]} is outside the vocabulary")
            ids = list(item)
        else:
            ids = list(self.tokenizer.encode(self.embedding.prefix + item))
        if not ids:
            raise PromptError(ErrorCode.INVALID_PROMPT, f"input[{i}] tokenizes to nothing")
        if len(ids) > self.context_length:
            raise PromptError(
                ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                f"input[{i}] is {len(ids)} tokens; the model takes at most {self.context_length}: shorten or split it",
            )
        return ids

    def _check_dimensions(self, dims: int) -> None:
        if not self.embedding.matryoshka:
            raise PromptError(
                ErrorCode.DIMENSIONS_NOT_SUPPORTED,
                f"{self.ref} does not declare Matryoshka dimensions, so its vectors cannot be truncated; drop "
                f"dimensions (its vectors have {self.dim})",
            )
        if dims > self.dim:
            raise PromptError(
                ErrorCode.DIMENSIONS_NOT_SUPPORTED, f"dimensions is {dims}; the model's vectors have {self.dim}"
            )


def load_decoder(ref: str, path: Path, *, context_length: int | None = None) -> EmbeddingModel:
    """A decoder embedding model through mlx_lm.load: hidden states from its `.model` call (before lm_head)."""
    config = read_config(path)
    try:
        model, tokenizer, model_config = mlx_lm.load(str(path), return_config=True)
    except Exception as exc:
        raise ModelLoadError(f"mlx_lm.load could not load {path}: {exc}") from exc
    body = model.model

    def forward(ids: mx.array, mask: mx.array) -> mx.array:
        return body(ids)  # right-padded rows: the causal mask alone keeps pads out of every real position

    def extend(ids: mx.array, caches: list[Any]) -> mx.array:
        return body(ids, cache=caches)

    def new_cache() -> list[Any]:
        return make_prompt_cache(model)

    plain = all(type(c) is KVCache for c in new_cache())  # rotating or recurrent caches cannot be copied per row

    return EmbeddingModel(
        ref=ref,
        path=path,
        model=model,
        tokenizer=tokenizer,
        config=model_config,
        identity=model_identity(path),
        context_length=context_length or context_length_of(model_config, path),
        embedding=config,
        forward=forward,
        causal=True,
        dim=int(model_config["hidden_size"]),
        extend=extend if plain else None,
        new_cache=new_cache if plain else None,
    )
