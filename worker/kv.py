"""KV caches over mlx-lm's cache classes: cheap views of cached prefixes, compaction, batched prefix prefill.

With engine.py, the only code that touches mlx-lm internals (cache classes, PromptProcessingBatch).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.generate import PromptProcessingBatch
from mlx_lm.models.cache import KVCache, make_prompt_cache

Caches = list[Any]


def view(caches: Caches, tokens: int, length: int) -> Caches:
    """Per-layer caches holding the first `length` of `tokens` cached tokens, safe to hand to BatchGenerator.

    BatchGenerator copies caches when it merges a batch, so a KVCache view is a slice, not a copy.
    """
    out = []
    for c in caches:
        if isinstance(c, KVCache):
            v = KVCache()
            if length:
                v.keys = c.keys[..., :length, :]
                v.values = c.values[..., :length, :]
            v.offset = length
            out.append(v)
        else:
            v = copy.copy(c)
            if length < tokens:
                v.trim(tokens - length)
            out.append(v)
    return out


def extendable(caches: Caches, tokens: int, length: int) -> Caches:
    """A copy of the first `length` tokens that the model may extend without touching `caches`."""
    if all(isinstance(c, KVCache) for c in caches):
        return view(caches, tokens, length)  # extending a slice allocates new arrays
    return [copy.deepcopy(c) for c in view(caches, tokens, length)]


def compact(c: Any) -> Any:
    """Drop a KVCache's unused preallocated tail so an entry's bytes are what it holds."""
    if isinstance(c, KVCache) and c.keys is not None and c.keys.shape[2] != c.offset:
        out = KVCache()
        out.keys = mx.contiguous(c.keys[..., : c.offset, :])
        out.values = mx.contiguous(c.values[..., : c.offset, :])
        out.offset = c.offset
        return out
    return c


def nbytes(caches: Caches) -> int:
    return int(sum(c.nbytes for c in caches))


def body_of(model: Any) -> Callable[..., Any]:
    """The model without its output projection, when it has the usual `.model` body; else the whole model.

    Prefilling a prefix needs logits only after its last token; projecting every position onto the vocabulary
    is wasted work (a large share of it for big vocabularies).
    """
    inner = getattr(model, "model", None)
    return inner if callable(inner) else model


def prefill(
    model: Any,
    bases: Sequence[Caches | None],
    suffixes: Sequence[list[int]],
    step: int,
) -> list[tuple[Caches, mx.array]]:
    """Extend each base cache (None: empty) by its suffix, in one batch; return (caches, last logits) for each.

    Every suffix has at least two tokens, or every suffix exactly one. Unequal lengths are right-padded by mlx-lm's
    PromptProcessingBatch; only the last token of each goes through the output projection.
    """
    caches = [b if b is not None else make_prompt_cache(model) for b in bases]
    batch = PromptProcessingBatch(body_of(model), uids=list(range(len(caches))), caches=caches, prefill_step_size=step)
    heads = [s[:-1] for s in suffixes]
    if any(heads):
        if not all(heads):
            raise ValueError("prefill: batch suffixes of one token apart from longer ones")
        batch.prompt(heads)
    logits = model(mx.array([[s[-1]] for s in suffixes]), cache=batch.prompt_cache)[:, -1, :]
    mx.eval(logits, [c.state for c in batch.prompt_cache])
    out = []
    for i in range(len(suffixes)):
        entry = [compact(c) for c in batch.extract_cache(i)]
        mx.eval([c.state for c in entry])
        out.append((entry, logits[i : i + 1]))
    return out
