"""Prompt logprobs (completions' echo): each prompt token's logprob and top alternatives, from a forward pass.

Batched and chunked, and able to continue a cached prefix. The decision for the prefix cache (issue 12): a
cached prefix keeps its PromptLogprobs (a few numbers per token, against tens of kilobytes of KV per token),
so a request whose prefix comes from the cache scores only its own suffix. Recomputing would run the shared
question of a multiple-choice item once per answer, which is what the planner exists to avoid. A suffix's
first token is scored from the logits after the prefix, which cache entries keep already.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, make_prompt_cache

from omlx_jobs.worker.extras.logits import log_softmax
from omlx_jobs.worker.extras.logprobs import TokenLogprob

# completions' logprobs go up to 5: keeping 5 alternatives per position serves every echo request.
TOP_K = 5
# Positions scored per forward chunk, over all rows: bounds the (rows, positions, vocabulary) logits in memory.
POSITIONS_PER_STEP = 256


@dataclass(frozen=True)
class PromptLogprobs:
    """Per-position logprobs of a run of prompt tokens: what a cache entry keeps for echo.

    `logprobs[i]` is token i's logprob given everything before it (NaN where nothing precedes: the first
    token of a whole prompt); `top_ids[i]` / `top_logprobs[i]` the most likely tokens there, most likely first.
    """

    tokens: np.ndarray  # (P,) int32
    logprobs: np.ndarray  # (P,) float32
    top_ids: np.ndarray  # (P, K) int32
    top_logprobs: np.ndarray  # (P, K) float32

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        return int(self.tokens.nbytes + self.logprobs.nbytes + self.top_ids.nbytes + self.top_logprobs.nbytes)

    def head(self, n: int) -> PromptLogprobs:
        """The first n positions (a shorter cached prefix)."""
        return PromptLogprobs(self.tokens[:n], self.logprobs[:n], self.top_ids[:n], self.top_logprobs[:n])

    def tail(self, n: int) -> PromptLogprobs:
        """All but the first n positions."""
        return PromptLogprobs(self.tokens[n:], self.logprobs[n:], self.top_ids[n:], self.top_logprobs[n:])

    def concat(self, other: PromptLogprobs) -> PromptLogprobs:
        """These positions followed by `other`'s (a cached prefix and the suffix scored after it)."""
        return PromptLogprobs(
            np.concatenate([self.tokens, other.tokens]),
            np.concatenate([self.logprobs, other.logprobs]),
            np.concatenate([self.top_ids, other.top_ids]),
            np.concatenate([self.top_logprobs, other.top_logprobs]),
        )

    def entries(self, top_n: int) -> list[TokenLogprob]:
        """As the engine hands logprobs over: one TokenLogprob per token, with `top_n` alternatives."""
        out = []
        for t, lp, ids, lps in zip(
            self.tokens.tolist(), self.logprobs.tolist(), self.top_ids.tolist(), self.top_logprobs.tolist(), strict=True
        ):
            if math.isnan(lp):
                out.append(TokenLogprob(t, None))
            else:
                out.append(TokenLogprob(t, lp, tuple(zip(ids[:top_n], lps[:top_n], strict=True))))
        return out


def _tile(caches: Sequence[Any], rows: int) -> list[KVCache]:
    """A batch of `rows` caches, each holding the same (batch 1) prefix."""
    out = []
    for c in caches:
        if not isinstance(c, KVCache):
            raise ValueError(f"prompt logprobs after a cached prefix need KVCache layers, not {type(c).__name__}")
        keys, values = c.keys_and_values()
        t = KVCache()
        t.state = (mx.repeat(keys, rows, axis=0), mx.repeat(values, rows, axis=0), c.offset)
        out.append(t)
    return out


def _row_cache(caches: Sequence[KVCache], row: int, length: int) -> list[KVCache]:
    """Row `row`'s own caches, cut at its length (the batch's shorter rows were right-padded)."""
    out = []
    for c in caches:
        keys, values = c.keys_and_values()
        r = KVCache()
        r.state = (keys[row : row + 1, :, :length], values[row : row + 1, :, :length], length)
        out.append(r)
    return out


def _score(logprobs: mx.array, targets: mx.array, top_k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rows, n, V) logprobs and (rows, n) next tokens -> their logprobs and the top_k alternatives."""
    chosen = mx.take_along_axis(logprobs, targets[..., None], axis=-1)[..., 0]
    k = min(top_k + 4, logprobs.shape[-1])  # a few spare, so ties at the cut go by token id
    idx = mx.argpartition(-logprobs, kth=k - 1, axis=-1)[..., :k]
    vals = mx.take_along_axis(logprobs, idx, axis=-1)
    mx.eval(chosen, idx, vals)
    ids_np, vals_np = np.array(idx, dtype=np.int32), np.array(vals, dtype=np.float32)
    order = np.lexsort((ids_np, -vals_np), axis=-1)[..., :top_k]
    return (
        np.array(chosen, dtype=np.float32),
        np.take_along_axis(ids_np, order, axis=-1),
        np.take_along_axis(vals_np, order, axis=-1),
    )


def _first_tokens(first: mx.array, logits: mx.array | None, top_k: int) -> tuple[np.ndarray, ...]:
    """Each prompt's first token, scored from the logits after the prefix (none without a prefix)."""
    rows = first.shape[0]
    if logits is None:
        return (
            np.full((rows, 1), np.nan, np.float32),
            np.full((rows, 1, top_k), -1, np.int32),
            np.full((rows, 1, top_k), np.nan, np.float32),
        )
    lsm = log_softmax(logits.reshape(1, 1, -1).astype(mx.float32))
    return _score(mx.repeat(lsm, rows, axis=0), first, top_k)


def prompt_logprobs(
    model: Any,
    prompts: Sequence[Sequence[int]],
    *,
    top_k: int = TOP_K,
    prefix: tuple[Sequence[Any], mx.array | None] | None = None,
    return_caches: bool = False,
    positions_per_step: int = POSITIONS_PER_STEP,
) -> list[tuple[PromptLogprobs, mx.array, list[KVCache] | None]]:
    """Score every token of each prompt in one batched pass; per prompt: its logprobs, the (V,) float32 logits
    after its last token (where generation starts) and, with return_caches, its own KV caches.

    `prefix`: (caches, logits) of a prefix every prompt continues: its batch-1 KV caches and the logits after
    its last token, which score each prompt's first token. Without one (or without those logits), a prompt's
    first token has none (NaN).
    """
    rows = len(prompts)
    lengths = [len(p) for p in prompts]
    if not rows or min(lengths) == 0:
        raise ValueError("prompt_logprobs needs non-empty prompts")
    longest = max(lengths)
    padded = mx.array([list(p) + [0] * (longest - len(p)) for p in prompts], dtype=mx.int32)
    caches = _tile(prefix[0], rows) if prefix is not None else make_prompt_cache(model)
    parts: list[list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = [[] for _ in prompts]
    last: list[mx.array | None] = [None] * rows
    lp, ids, vals = _first_tokens(padded[:, :1], prefix[1] if prefix is not None else None, top_k)
    for i in range(rows):
        parts[i].append((lp[i], ids[i], vals[i]))
    step = max(1, positions_per_step // rows)
    for start in range(0, longest, step):
        n = min(step, longest - start)
        logits = model(padded[:, start : start + n], cache=caches)
        for i, length in enumerate(lengths):
            if start <= length - 1 < start + n:  # a copy: a slice would keep the chunk's logits alive
                last[i] = mx.array(np.array(logits[i, length - 1 - start].astype(mx.float32)))
        # Position j's logits score token j + 1; the chunk's last position scores the next chunk's first token.
        m = min(n, longest - 1 - start)
        if m > 0:
            targets = padded[:, start + 1 : start + 1 + m]
            lp, ids, vals = _score(log_softmax(logits[:, :m].astype(mx.float32)), targets, top_k)
            for i, length in enumerate(lengths):
                keep = max(0, min(m, length - 1 - start))
                if keep:
                    parts[i].append((lp[i, :keep], ids[i, :keep], vals[i, :keep]))
        mx.eval([x for x in last if x is not None], [c.keys_and_values() for c in caches])
    out = []
    for i, p in enumerate(prompts):
        result = PromptLogprobs(
            np.array(p, dtype=np.int32),
            np.concatenate([a for a, _, _ in parts[i]]),
            np.concatenate([b for _, b, _ in parts[i]]),
            np.concatenate([c for _, _, c in parts[i]]),
        )
        own = _row_cache(caches, i, (prefix_len(prefix) if prefix else 0) + lengths[i]) if return_caches else None
        out.append((result, last[i], own))  # type: ignore[arg-type]
    return out


def prefix_len(prefix: tuple[Sequence[Any], mx.array | None]) -> int:
    return int(prefix[0][0].offset)
