"""A text model loaded once: its weights and tokenizer, its identity and context length, and its prompts."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx_lm

from omlx_jobs.errors import ErrorCode
from omlx_jobs.jobs.formats import CHAT_URL, EMBEDDINGS_URL
from omlx_jobs.jobs.parts import image_urls
from omlx_jobs.worker.backend.model import ModelBackend
from omlx_jobs.worker.models.paths import ModelLoadError, context_length_of, model_identity
from omlx_jobs.worker.prompts import ImageError, Prompt, PromptError
from omlx_jobs.worker.reasoning.plan import ChatModel, ChatPlan


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
    """The mlx-vlm model of a vision model (vision/loaded.py's VisionLoaded); None for text."""

    def prompt(self, endpoint: str, body: dict[str, Any]) -> Prompt:
        """The request's prompt: tokens, and for a vision model where each image sits (its key names them)."""
        return Prompt.from_tokens(self.encode(endpoint, body))

    def backend(self, **kw: Any) -> ModelBackend:
        """The engine's backend for this model (a vision model's computes image positions from embeddings)."""
        return ModelBackend(self.model, **kw)

    @functools.cached_property
    def chat(self) -> ChatModel:
        """What the chat template says about thinking and tools (worker/reasoning/plan.py), found once."""
        return ChatModel.of(self.tokenizer)

    def chat_plan(self, endpoint: str, body: dict[str, Any], prompt: list[int]) -> ChatPlan | None:
        """A chat request's reasoning and tool-call plan; None for completions and plain answers."""
        return self.chat.plan(body, prompt) if endpoint == CHAT_URL else None

    @property
    def vocab_size(self) -> int:
        return int(self.config.get("vocab_size") or len(self.tokenizer.get_vocab()))

    def encode(self, endpoint: str, body: dict[str, Any]) -> list[int]:
        """Prompt tokens: messages through the chat template, a completion prompt tokenized as given."""
        if endpoint == EMBEDDINGS_URL:
            raise PromptError(
                ErrorCode.NOT_AN_EMBEDDING_MODEL,
                f"this is an embeddings request, but {self.ref} is a generation model; send embeddings to a worker "
                "of an embedding model (one with a sentence-transformers Pooling module)",
            )
        if endpoint == CHAT_URL:
            return self._encode_chat(body)
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

    def _encode_chat(self, body: dict[str, Any]) -> list[int]:
        check_accepts_images(body["messages"], model_is_vision=False, model=self.ref)  # mlx_lm.load: text-only
        tok = self.tokenizer
        if not getattr(tok, "chat_template", None):
            raise PromptError(
                ErrorCode.NO_CHAT_TEMPLATE, "this model has no chat template; send prompts to /v1/completions instead"
            )
        messages, kwargs = self.chat.render_kwargs(body)  # tools, enable_thinking, chat_template_kwargs
        # A final assistant message is continued (a prefill), not answered.
        cont = messages[-1]["role"] == "assistant"
        try:
            ids = tok.apply_chat_template(
                messages,
                add_generation_prompt=not cont,
                continue_final_message=cont,
                tokenize=True,
                **kwargs,
            )
        except Exception as exc:  # jinja raises for roles or orders a template does not support
            message = f"the chat template rejected these messages: {exc}"
            raise PromptError(ErrorCode.CHAT_TEMPLATE_ERROR, message) from exc
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]


def load_text(ref: str, path: Path, *, context_length: int | None = None) -> LoadedModel:
    """Load the text model in `path` (resolved from `ref`) with mlx_lm.load, once per worker."""
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


def check_accepts_images(messages: list[dict[str, Any]], model_is_vision: bool, model: str) -> None:
    """ImageError (images_not_supported) if a text-only model gets a request with images."""
    if not model_is_vision and next(image_urls(messages), None) is not None:
        raise ImageError(
            ErrorCode.IMAGES_NOT_SUPPORTED,
            f"this request has images, but {model} is a text-only model; send it to a vision model "
            "(e.g. a Qwen2-VL) or drop the image parts",
        )
