"""Per-request samplers and logits processors, built from mlx-lm's sample_utils.

Requests with equal parameters share one sampler object, so BatchGenerator samples them in one call.
A seeded request gets its own sampler with its own random key, so its output does not depend on batching.
Shared samplers carry `filtered` (their processing without the draw), which speculative verification uses;
seeded ones do not, so seeded rows are never speculated and their output is the same with speculation on or off.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    make_logits_processors,
    make_sampler,
)

from omlx_jobs.jobs.formats import SamplingParams

Sampler = Callable[[mx.array], mx.array]


def _is_greedy(p: SamplingParams) -> bool:
    return p.temperature == 0


def _filters_top_k(top_k: int, vocab: int) -> bool:
    """top_k at or above the vocabulary keeps every token: no filter (mlx-lm's would raise past it)."""
    return 0 < top_k < vocab


def _seeded_sampler(p: SamplingParams, choice: int) -> Sampler:
    key = mx.random.key((p.seed or 0) + choice)
    state = {"key": key}

    def sampler(logprobs: mx.array) -> mx.array:
        state["key"], sub = mx.random.split(state["key"])
        return mx.random.categorical(filtered(p, logprobs), key=sub)

    return sampler


def filtered(p: SamplingParams, logprobs: mx.array) -> mx.array:
    """The logits a sampler for `p` draws its token from (top-p, min-p, top-k as mlx-lm applies them, then the
    temperature): what speculative verification (worker/speculation/verify.py) accepts drafts against."""
    if 0 < p.top_p < 1.0:
        logprobs = apply_top_p(logprobs, p.top_p)
    if p.min_p:
        logprobs = apply_min_p(logprobs, p.min_p)
    if _filters_top_k(p.top_k, logprobs.shape[-1]):
        logprobs = apply_top_k(logprobs, p.top_k)
    return logprobs * (1 / p.temperature)


def _shared_sampler(p: SamplingParams) -> Sampler:
    """mlx-lm's sampler for these parameters, with top_k clamped to the vocabulary: validation cannot know
    the vocabulary, so a top_k larger than it is taken as no top-k filter (the vocabulary is read from the
    logits on the first call; one model per worker, so it does not change)."""
    if not p.top_k:
        return make_sampler(temp=p.temperature, top_p=p.top_p, min_p=p.min_p)
    by_vocab: dict[int, Sampler] = {}

    def sampler(logprobs: mx.array) -> mx.array:
        vocab = logprobs.shape[-1]
        if vocab not in by_vocab:
            top_k = p.top_k if _filters_top_k(p.top_k, vocab) else 0
            by_vocab[vocab] = make_sampler(temp=p.temperature, top_p=p.top_p, min_p=p.min_p, top_k=top_k)
        return by_vocab[vocab](logprobs)

    return sampler


class SamplerFactory:
    """Hands out samplers; unseeded requests with the same parameters get the same object."""

    def __init__(self) -> None:
        self._shared: dict[tuple[Any, ...], Sampler | None] = {}

    def sampler(self, p: SamplingParams, choice: int = 0) -> Sampler | None:
        """None means greedy (BatchGenerator's batched default). Choice i of a seeded request uses seed + i."""
        if _is_greedy(p):
            return None
        if p.seed is not None:
            return _seeded_sampler(p, choice)
        key = (p.temperature, p.top_p, p.min_p, p.top_k)
        if key not in self._shared:
            shared = _shared_sampler(p)
            shared.filtered = functools.partial(filtered, p)  # type: ignore[attr-defined]  # speculation's
            self._shared[key] = shared
        return self._shared[key]

    @staticmethod
    def logits_processors(p: SamplingParams) -> list[Any]:
        if p.repetition_penalty is None and p.presence_penalty is None and p.frequency_penalty is None:
            return []
        return make_logits_processors(
            repetition_penalty=p.repetition_penalty,
            presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty,
        )
