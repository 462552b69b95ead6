"""The batched prefill-only runner: inputs in length-sorted batches (batching.py), right-padded, one forward
pass each (no decode loop, no KV cache kept), pooled over each row's own positions, normalized, truncated.

Padding is masked exactly: a causal model's rows are right-padded, so no real position attends to a pad (its
mask is the causal one), and pooling reads only real positions; an encoder gets the padding mask itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import mlx.core as mx
import numpy as np

from omlx_jobs.worker.embeddings.batching import plan_batches
from omlx_jobs.worker.embeddings.pooling import EmbeddingConfig

Forward = Callable[[mx.array, mx.array], mx.array]
"""(token ids (B, L), mask (B, L): 1 at real positions) -> hidden states (B, L, D)."""


def pool(hidden: mx.array, lengths: mx.array, pooling: str, starts: mx.array | None = None) -> mx.array:
    """One vector per row of right-padded hidden states (B, L, D), from its first `lengths[b]` positions; a mean
    leaves out each row's first `starts[b]` (an instruction prompt the model's pooling excludes)."""
    rows = hidden.shape[0]
    if pooling == "lasttoken":
        return hidden[mx.arange(rows), lengths - 1]
    if pooling == "cls":
        return hidden[:, 0]
    starts = mx.zeros_like(lengths) if starts is None else starts
    return masked_sum(hidden, starts, lengths) / (lengths - starts)[:, None].astype(hidden.dtype)


def masked_sum(hidden: mx.array, starts: mx.array, ends: mx.array) -> mx.array:
    """Each row's hidden states (B, L, D) summed over positions [starts[b], ends[b])."""
    positions = mx.arange(hidden.shape[1])[None, :]
    mask = ((positions >= starts[:, None]) & (positions < ends[:, None])).astype(hidden.dtype)
    return (hidden * mask[..., None]).sum(axis=1)


def finish(vectors: np.ndarray, normalize: bool, dimensions: int | None = None) -> np.ndarray:
    """Unit length if the model normalizes; then a Matryoshka truncation to `dimensions`, renormalized."""
    out = vectors.astype(np.float32)
    if normalize:
        out = out / np.maximum(np.linalg.norm(out, axis=-1, keepdims=True), 1e-12)
    if dimensions is not None and dimensions < out.shape[-1]:
        out = out[..., :dimensions]
        out = out / np.maximum(np.linalg.norm(out, axis=-1, keepdims=True), 1e-12)
    return np.ascontiguousarray(out, dtype=np.float32)


class BatchRunner:
    """Embeds lists of token ids in batches under `token_budget` padded tokens (and `max_rows` rows)."""

    def __init__(
        self,
        forward: Forward,
        config: EmbeddingConfig,
        *,
        pad_id: int = 0,
        token_budget: int = 8192,
        max_rows: int = 256,
        pad_to: int = 1,
    ) -> None:
        self.forward, self.config, self.pad_id = forward, config, pad_id
        self.token_budget, self.max_rows, self.pad_to = token_budget, max_rows, pad_to
        self.padded_tokens = 0
        """Positions computed so far, padding included."""

    def embed(self, inputs: Sequence[Sequence[int]]) -> np.ndarray:
        """Pooled vectors (N, D) of `inputs`, in their order, before normalization (finish() does that)."""
        lengths = [len(t) for t in inputs]
        out: list[np.ndarray | None] = [None] * len(inputs)
        for batch in plan_batches(lengths, self.token_budget, self.max_rows):
            vectors = self.embed_batch([inputs[i] for i in batch])
            for row, i in enumerate(batch):
                out[i] = vectors[row]
        return np.stack(out) if out else np.zeros((0, 0), np.float32)  # type: ignore[arg-type]

    def embed_batch(self, rows: Sequence[Sequence[int]], starts: Sequence[int] | None = None) -> np.ndarray:
        """One forward pass over right-padded `rows`, pooled: (len(rows), D) float32. `starts`: leading positions
        of each row a mean leaves out."""
        ids, mask = right_pad(rows, self.pad_id, self.pad_to)
        lengths = mx.array([len(r) for r in rows])
        hidden = self.forward(mx.array(ids), mx.array(mask))
        begin = mx.array(list(starts)) if starts is not None else None
        pooled = pool(hidden.astype(mx.float32), lengths, self.config.pooling, begin)
        mx.eval(pooled)
        self.padded_tokens += ids.size
        return np.array(pooled, dtype=np.float32)


def right_pad(rows: Sequence[Sequence[int]], pad_id: int, pad_to: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Token ids (B, L) right-padded with `pad_id` to the longest row rounded up to a multiple of `pad_to`, and
    the mask (1 at real positions)."""
    longest = -(-max(len(r) for r in rows) // pad_to) * pad_to
    ids = np.full((len(rows), longest), pad_id, dtype=np.int32)
    mask = np.zeros((len(rows), longest), dtype=np.int32)
    for b, r in enumerate(rows):
        ids[b, : len(r)] = r
        mask[b, : len(r)] = 1
    return ids, mask
