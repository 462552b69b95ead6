"""Prefill an image prompt from its input embeddings into mlx-lm KV caches, ready for BatchGenerator.

prefill() embeds the prompt (text tokens through the embedding table, image tokens from the vision features),
runs it through mlx-vlm's language model at the family's true positions (mRoPE for Qwen2-VL), and returns the
caches, the logits asked for and the request's RoPE delta. It can continue from caches that already hold a
prefix (`start` tokens) and stop before the end (`end`): images wholly outside [start, end) are not encoded.

The caches are mlx-lm's KVCache class, so kv views, the prefix cache and BatchGenerator take them as they are.
cache/positioned.PositionedKVCache adds the one per-request state decoding needs: the RoPE delta after each
image, which BatchGenerator's merge turns into that row's position offset.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from omlx_jobs.worker.cache.positioned import PositionedKVCache, positioned
from omlx_jobs.worker.vision.model import ImageFeatures, VisionModel
from omlx_jobs.worker.vision.prompt import VisionPrompt

DEFAULT_PREFILL_STEP = 2048


@dataclass
class Prefilled:
    """A prompt run through the model: caches holding it up to `end`, the logits wanted, and the RoPE delta."""

    caches: list[PositionedKVCache]
    logits: mx.array  # (vocab,): after the last token computed
    rope_delta: int
    computed: int
    """Prompt tokens computed here (the rest were in the caches given)."""
    picked: dict[int, mx.array] = field(default_factory=dict)
    """Logits (1, vocab) after each position asked for in `want` (0-based from `start`)."""


def prefill(
    vm: VisionModel,
    prompt: VisionPrompt,
    *,
    caches: list[Any] | None = None,
    start: int = 0,
    end: int | None = None,
    want: set[int] | frozenset[int] = frozenset(),
    step: int = DEFAULT_PREFILL_STEP,
) -> Prefilled:
    """Run prompt.tokens[start:end] from embeddings on top of `caches` (which hold the first `start` tokens)."""
    n = len(prompt) if end is None else end
    if not 0 <= start < n <= len(prompt):
        raise ValueError(f"need 0 <= start < end <= {len(prompt)}, got {start}, {n}")
    if caches is None:
        if start:
            raise ValueError("start > 0 needs the caches that hold those tokens")
        caches = fresh_caches(vm)
    elif caches[0].offset != start:
        raise ValueError(f"the caches hold {caches[0].offset} tokens, not start={start}")
    images = prompt.extra.get("images", ())
    features = [
        vm.image_features(im) if span.end > start and span.start < n else None
        for span, im in zip(prompt.spans, images, strict=True)
    ]
    ids = mx.array([prompt.tokens])
    positions, delta = rope_positions(vm, prompt, features)
    embeds = input_embeddings(vm, prompt, features, start, n)
    deep = [deep_inputs(prompt, features, start, n)]
    picked: dict[int, mx.array] = {}
    want = set(want) | {n - 1 - start}
    for a in range(start, n, step):
        b = min(a + step, n)
        pos = positions[..., a:b] if positions is not None else None
        chunk = deep_chunk(deep, a - start, b - start)
        hidden = vm.family.forward(vm, ids[:, a:b], embeds[:, a - start : b - start], caches, pos, chunk)
        rows = [j for j in sorted(want) if a <= j + start < b]
        if rows:
            out = vm.family.project(vm, mx.stack([hidden[0, j + start - a] for j in rows]))
            picked.update({j: out[k : k + 1] for k, j in enumerate(rows)})
        mx.eval([c.state for c in caches], list(picked.values()))
    logits = picked[n - 1 - start][0]
    breaks = rope_breaks(prompt, positions, n)
    return Prefilled(positioned(caches, breaks), logits, delta, n - start, picked)


def prefill_rows(
    vm: VisionModel,
    prompts: list[VisionPrompt],
    bases: list[list[Any] | None],
    ends: list[int],
    wants: list[set[int]],
    *,
    step: int = DEFAULT_PREFILL_STEP,
) -> list[Prefilled]:
    """prefill() for several prompts in one batch: each runs tokens[start:end] on its base caches, all bases of
    the same length `start`. Shorter rows are right-padded: attention is causal, so a row never sees its
    padding, and its caches are cut at its end."""
    starts = {b[0].offset if b else 0 for b in bases}
    if len(starts) != 1:
        raise ValueError(f"batched rows need bases of one length, got {sorted(starts)}")
    start = starts.pop()
    lm = vm.model.language_model
    width = max(ends) - start
    inputs = [_row_inputs(vm, prompt, start, end, width) for prompt, end in zip(prompts, ends, strict=True)]
    embeds = [e for e, _, _, _, _ in inputs]
    deep = [d for _, _, _, _, d in inputs]
    positions = [p for _, p, _, _, _ in inputs if p is not None]
    pos_all = mx.concatenate(positions, axis=1) if len(positions) == len(prompts) else None
    emb = mx.concatenate(embeds, axis=0)
    batch = _stack_caches(bases, len(lm.model.layers), start)
    ids = mx.zeros((len(prompts), width), dtype=mx.int32)
    picked: list[dict[int, mx.array]] = [{} for _ in prompts]
    wants = [set(w) | {e - 1 - start} for w, e in zip(wants, ends, strict=True)]
    for a in range(0, width, step):
        b = min(a + step, width)
        pos = pos_all[..., a:b] if pos_all is not None else None
        hidden = vm.family.forward(vm, ids[:, a:b], emb[:, a:b], batch, pos, deep_chunk(deep, a, b))
        picks = [(i, j) for i, w in enumerate(wants) for j in sorted(w) if a <= j < b]
        if picks:
            out = vm.family.project(vm, mx.stack([hidden[i, j - a] for i, j in picks]))
            for k, (i, j) in enumerate(picks):
                picked[i][j] = out[k : k + 1]
        mx.eval([c.state for c in batch], [v for d in picked for v in d.values()])
    out_rows = []
    for i, (prompt, end) in enumerate(zip(prompts, ends, strict=True)):
        caches = []
        for c in batch:
            k = KVCache()
            k.keys, k.values, k.offset = c.keys[i : i + 1, :, :end], c.values[i : i + 1, :, :end], end
            caches.append(k)
        _, _, full, delta, _ = inputs[i]
        breaks = rope_breaks(prompt, full, end)
        last = picked[i][end - 1 - start][0]
        out_rows.append(Prefilled(positioned(caches, breaks), last, delta, end - start, picked[i]))
    return out_rows


def _row_inputs(
    vm: VisionModel, prompt: VisionPrompt, start: int, end: int, width: int
) -> tuple[mx.array, mx.array | None, mx.array | None, int, Any]:
    """One batched row's embeddings for [start, end), right-padded to `width`; its positions there (padding
    positions run on from the row's last one); its positions over the whole prompt; its RoPE delta; its
    deepstack inputs (deep_inputs)."""
    images = prompt.extra.get("images", ())
    feats = [
        vm.image_features(im) if s.end > start and s.start < end else None
        for s, im in zip(prompt.spans, images, strict=True)
    ]
    pos, delta = rope_positions(vm, prompt, feats)
    e = input_embeddings(vm, prompt, feats, start, end)
    e = mx.pad(e, [(0, 0), (0, width - e.shape[1]), (0, 0)])
    cut = None
    if pos is not None:
        cut = pos[..., start:end]
        if start + width > end:
            cut = mx.concatenate([cut, cut[..., -1:] + mx.arange(1, start + width - end + 1)], axis=-1)
    return e, cut, pos, delta, deep_inputs(prompt, feats, start, end)


def _stack_caches(bases: list[list[Any] | None], layers: int, start: int) -> list[KVCache]:
    """One KVCache per layer holding every base along the batch axis (empty ones when start is 0)."""
    out = []
    for layer in range(layers):
        c = KVCache()
        if start:
            keys = [b[layer].keys[..., :start, :] for b in bases if b is not None]
            values = [b[layer].values[..., :start, :] for b in bases if b is not None]
            c.keys, c.values = mx.concatenate(keys, axis=0), mx.concatenate(values, axis=0)
            c.offset = start
        out.append(c)
    return out


def rope_breaks(prompt: VisionPrompt, positions: mx.array | None, end: int) -> tuple[tuple[int, int], ...]:
    """(position, delta) after each image that ends before `end`: where text starts running behind its index."""
    if positions is None:
        return ()
    row = positions[0, 0]
    ends = [s.end for s in prompt.spans if s.end < len(prompt) and s.end <= end]
    values = row[mx.array(ends)].tolist() if ends else []
    return tuple((e, int(v) - e) for e, v in zip(ends, values, strict=True))


def input_embeddings(
    vm: VisionModel, prompt: VisionPrompt, features: list[ImageFeatures | None], start: int = 0, end: int | None = None
) -> mx.array:
    """(1, end - start, hidden): token embeddings, with each image's features at its image positions."""
    dtype = vm.model.language_model.model.norm.weight.dtype  # not embed's: a quantized table's weight is packed
    end = len(prompt) if end is None else end
    pieces = []
    pos = start
    for span, feat in zip(prompt.spans, features, strict=True):
        if span.end <= start:
            continue
        if span.start >= end:
            break
        if span.start > pos:
            pieces.append(vm.family.embed(vm, mx.array(prompt.tokens[pos : span.start])))
        if feat is None or feat.tokens != span.length:
            raise ValueError(f"image at {span.start} has {span.length} tokens but no features of that size")
        lo, hi = max(pos, span.start), min(span.end, end)
        pieces.append(feat.features[lo - span.start : hi - span.start].astype(dtype))
        pos = hi
    if pos < end:
        pieces.append(vm.family.embed(vm, mx.array(prompt.tokens[pos:end])))
    return mx.concatenate(pieces, axis=0)[None]


def deep_inputs(
    prompt: VisionPrompt, features: list[ImageFeatures | None], start: int, end: int
) -> tuple[list[bool], mx.array] | None:
    """Qwen3-VL's deepstack inputs over [start, end): which positions are image positions, and the features
    added to the early layers' hidden states there, (layers, image positions, hidden). None without any."""
    mask, pieces = [False] * (end - start), []
    for span, feat in zip(prompt.spans, features, strict=True):
        lo, hi = max(span.start, start), min(span.end, end)
        if lo >= hi or feat is None or feat.deep is None:
            continue
        mask[lo - start : hi - start] = [True] * (hi - lo)
        pieces.append(feat.deep[:, lo - span.start : hi - span.start])
    return (mask, mx.concatenate(pieces, axis=1)) if pieces else None


def deep_chunk(rows: list[tuple[list[bool], mx.array] | None], a: int, b: int) -> tuple[mx.array, mx.array] | None:
    """Columns [a, b) of a batch's deepstack inputs: the (rows, b - a) mask, and the features of its image
    positions in batch-major order, as mlx-vlm's language model takes them. None when the chunk holds none."""
    masks, parts = [], []
    for row in rows:
        mask = (row[0] if row is not None else [])[a:b]
        masks.append(mask + [False] * (b - a - len(mask)))
        if row is not None and any(mask):
            before = sum(row[0][:a])
            parts.append(row[1][:, before : before + sum(mask)])
    return (mx.array(masks), mx.concatenate(parts, axis=1)) if parts else None


def rope_positions(
    vm: VisionModel, prompt: VisionPrompt, features: list[ImageFeatures | None]
) -> tuple[mx.array | None, int]:
    """The family's position ids for the whole prompt and the RoPE delta after it (None, 0 for 1-D RoPE)."""
    return vm.family.positions(vm, prompt, features)


def fresh_caches(vm: VisionModel) -> list[Any]:
    """Empty layer caches: mlx-lm's own for sliding-window families (rotating layers), else KVCache layers."""
    if vm.family.sliding:
        return vm.decode_model().make_cache()
    return [KVCache() for _ in vm.model.language_model.model.layers]
