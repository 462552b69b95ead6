"""KV caches over mlx-lm's cache classes: cheap views of cached prefixes, compaction, batched prefix prefill.

With engine.py, warmup.py and attention.py, the only code that touches mlx-lm internals (cache classes,
PromptProcessingBatch).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.generate import _merge_caches, _right_pad_prompts
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


def nbytes(caches: Caches) -> int:
    return int(sum(c.nbytes for c in caches))


# Models whose __call__ is `project(model.model(x))` with nothing in between (checked for mlx-lm 0.32.2):
# for them a prefill runs the body alone and projects only the positions whose logits are wanted.
SPLIT_HEAD_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "mistral"})


def _projection(model: Any) -> Callable[[mx.array], mx.array] | None:
    if getattr(model, "model_type", None) not in SPLIT_HEAD_MODEL_TYPES or not callable(getattr(model, "model", None)):
        return None
    if hasattr(model, "lm_head"):
        return model.lm_head
    return model.model.embed_tokens.as_linear


def prefill(
    model: Any,
    bases: Sequence[Caches | None],
    suffixes: Sequence[list[int]],
    step: int,
    want: Sequence[set[int]],
) -> list[tuple[Caches, dict[int, mx.array]]]:
    """Extend each base cache (None: empty) by its suffix, all in one batch.

    Returns, per sequence, its caches and the logits after each suffix position in `want` (0-based). Unequal
    lengths are right-padded as mlx-lm's PromptProcessingBatch does. Only wanted positions are projected onto
    the vocabulary where the model allows it: the rest of that work is wasted (a large share with big
    vocabularies).
    """
    caches = [b if b is not None else make_prompt_cache(model) for b in bases]
    batch = _merge_caches(caches)
    lengths = [len(s) for s in suffixes]
    longest = max(lengths)
    padding = [longest - n for n in lengths]
    tokens = _right_pad_prompts(list(suffixes), max_length=longest)
    if max(padding):
        for c in batch:
            c.prepare(lengths=lengths, right_padding=padding)
    project = _projection(model)
    run = model.model if project is not None else model
    logits: list[dict[int, mx.array]] = [{} for _ in suffixes]
    for start in range(0, longest, step):
        n = min(step, longest - start)
        h = run(tokens[:, start : start + n], cache=batch)
        picks = [(i, j) for i, ws in enumerate(want) for j in sorted(ws) if start <= j < start + n]
        if picks:
            rows = mx.stack([h[i, j - start] for i, j in picks])
            rows = project(rows) if project is not None else rows
            for k, (i, j) in enumerate(picks):
                logits[i][j] = rows[k : k + 1]
        mx.eval([c.state for c in batch], [v for d in logits for v in d.values()])
    if max(padding):
        for c in batch:
            c.finalize()
    out = [[c.extract(i) for c in batch] for i in range(len(suffixes))]
    mx.eval([c.state for caches_i in out for c in caches_i])
    return list(zip(out, logits, strict=True))
