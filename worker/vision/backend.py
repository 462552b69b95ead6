"""The vision backend: the text backend, plus image positions computed from embeddings before a row goes in.

The engine runs a vision model's requests as it runs text (engine/loop.py): one scheduler, one prefix cache, one
BatchGenerator decoding image and text rows together through mlx-lm's text model for the family
(VisionModel.decode_model). Token ids cannot carry an image, so every position of an image is computed here,
from the vision features, before a row goes in:
- warm-ups of shared prefixes that hold images (one system prompt and one image, many questions) run through
  VisionBackend.prefill, which the warm-ups call with the prompts their suffixes come from;
- at admission, VisionBackend.media_prefix extends the request's best cached prefix through its last image
  and hands that prefix to the row (through the prefix cache), so the batch only ever prefills text.
Caches carry their RoPE breaks (cache/positioned.PositionedKVCache), so a row's text runs at its true mRoPE
positions, whatever prefix it starts from. Families without an adapter (vision/families/) run on serial.py instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from omlx_jobs.worker.backend.model import ModelBackend
from omlx_jobs.worker.backend.rows import Caches
from omlx_jobs.worker.cache import kv
from omlx_jobs.worker.cache.positioned import breaks_of, positioned
from omlx_jobs.worker.cache.prefix_cache import Entry, Match, PrefixCache
from omlx_jobs.worker.prompts import Prompt
from omlx_jobs.worker.vision import prefill as image_prefill
from omlx_jobs.worker.vision.inputs.media import has_media, media_end, vision_prompt
from omlx_jobs.worker.vision.model import VisionModel


class VisionBackend(ModelBackend):
    """The text backend, plus image positions computed from embeddings through mlx-vlm's language model."""

    def __init__(self, vm: VisionModel, model: Any, **kw: Any) -> None:
        super().__init__(model, **kw)
        self.vm = vm
        if vm.family.sliding:
            # mlx-lm's RotatingKVCache says it can trim while it holds fewer tokens than its window, but a cached
            # prefix longer than the window cannot be cut back: entries are reused whole (the prefix cache and
            # the warm-up planner then only reuse whole cached prefixes, never trimmed ones).
            self.trimmable = False
        self._ready: dict[int, tuple[Match, int]] = {}
        """Image prefixes computed for a window's admissions, by admission position (and tokens computed)."""

    def before_admit(self, admissions: Sequence[Any], cache: PrefixCache, *, keep: bool) -> None:
        """Compute the image prefixes of a window's admissions together (media_prefix hands them out): one
        batched pass instead of one per request. With `keep`, a prefix already cached is held for its row, and
        requests of the window with the same images after the same text share one computation."""
        self._ready = {}
        todo: dict[Any, tuple[list[int], Prompt, Match | None, int]] = {}
        for a in admissions:
            prompt, position = a.work.prompt, a.position
            if not prompt.media:
                continue
            end = media_end(prompt)
            key = prompt.prefix_key(end) if keep else position
            if key in todo:
                todo[key][0].append(position)
                continue
            match = cache.lookup(prompt.key, limit=end, count=False) if keep else None
            if match is not None and match.length >= end:
                cache.hold(match.entry, position)  # until its row has taken it
                continue
            todo[key] = ([position], prompt, match, end)
        if not todo:
            return
        items = list(todo.values())
        starts = [m.length if m is not None else 0 for _, _, m, _ in items]
        bases = [kv.extendable(m.entry.value, m.entry.tokens, m.length) if m else None for _, _, m, _ in items]
        suffixes = [p.tokens[s:end] for (_, p, _, end), s in zip(items, starts, strict=True)]
        done = self.prefill(bases, suffixes, [set() for _ in items], [p for _, p, _, _ in items])
        for (positions, prompt, _, end), start, (caches, _) in zip(items, starts, done, strict=True):
            key, size = prompt.prefix_key(end), kv.nbytes(caches)
            if keep:
                entry = cache.add(key, caches, size, needed_until=max(positions), pin=True)
            else:
                entry = Entry(key, caches, size)
            for k, position in enumerate(positions):  # the first computed it; the others reuse it
                self._ready[position] = (Match(entry, end), end - start if k == 0 else 0)

    def prefill(
        self,
        bases: Sequence[Caches | None],
        suffixes: Sequence[list[int]],
        want: Sequence[set[int]],
        prompts: Sequence[Prompt] | None = None,
    ) -> list[tuple[Caches, dict[int, Any]]]:
        """As ModelBackend.prefill; suffixes holding image positions run from their embeddings (those on bases
        of one length together), the rest together by token ids. Every cache comes back with its RoPE breaks."""
        starts = [b[0].offset if b else 0 for b in bases]
        media = [
            i
            for i, (s, suffix) in enumerate(zip(starts, suffixes, strict=True))
            if prompts is not None and has_media(prompts[i], s, s + len(suffix))
        ]
        out: dict[int, Any] = {}
        text = [i for i in range(len(suffixes)) if i not in media]
        if text:
            done = super().prefill([bases[i] for i in text], [suffixes[i] for i in text], [want[i] for i in text])
            for i, (caches, logits) in zip(text, done, strict=True):
                out[i] = (positioned(caches, breaks_of(bases[i])), logits)
        groups: dict[int, list[int]] = {}
        for i in media:  # rows on bases of one length run together, right-padded
            groups.setdefault(starts[i], []).append(i)
        for start, rows in groups.items():
            for k in range(0, len(rows), self.prefill_batch_size):
                chunk = rows[k : k + self.prefill_batch_size]
                assert prompts is not None
                done = self._prefill_media(chunk, start, bases, suffixes, want, prompts)
                out.update(done)
        return [out[i] for i in range(len(suffixes))]

    def _prefill_media(
        self,
        rows: list[int],
        start: int,
        bases: Sequence[Caches | None],
        suffixes: Sequence[list[int]],
        want: Sequence[set[int]],
        prompts: Sequence[Prompt],
    ) -> dict[int, tuple[Caches, dict[int, Any]]]:
        ends = [start + len(suffixes[i]) for i in rows]
        views = [vision_prompt(prompts[i]) for i in rows]
        caches = [list(bases[i]) if bases[i] is not None else None for i in rows]
        if len(rows) == 1 or self.vm.family.sliding:  # rotating caches: one row at a time
            done = [
                image_prefill.prefill(self.vm, v, caches=c, start=start, end=e, want=want[i])
                for i, v, c, e in zip(rows, views, caches, ends, strict=True)
            ]
        else:
            done = image_prefill.prefill_rows(self.vm, views, caches, ends, [want[i] for i in rows])
        return {i: (pf.caches, {j: pf.picked[j] for j in want[i]}) for i, pf in zip(rows, done, strict=True)}

    def media_prefix(
        self, cache: PrefixCache, prompt: Prompt, match: Match | None, position: int, *, keep: bool
    ) -> tuple[Match, int]:
        """A prefix covering every image of `prompt`, for its row to start from; and how many tokens were
        computed for it here (0 when a cached prefix already covers the images).

        The prefix is the best cached one (`match`), extended through the last image from embeddings. With
        `keep` (prefix reuse on) it goes into the prefix cache, held until admission passes `position`, and later
        requests with the same image after the same text reuse it; without, only this row takes it.
        """
        ready = self._ready.pop(position, None)
        if ready is not None:  # computed with its window (before_admit)
            return ready
        end = media_end(prompt)
        if match is not None and match.length >= end:
            cache.hold(match.entry, position)  # kept until the row has taken it
            return match, 0
        start = match.length if match is not None else 0
        base = kv.extendable(match.entry.value, match.entry.tokens, start) if match is not None else None
        ((caches, _),) = self.prefill([base], [prompt.tokens[start:end]], [set()], [prompt])
        key, size = prompt.prefix_key(end), kv.nbytes(caches)
        # Without prefix reuse the row takes the prefix directly, and it is gone with the row.
        entry = cache.add(key, caches, size, needed_until=position, pin=True) if keep else Entry(key, caches, size)
        return Match(entry, end), end - start
