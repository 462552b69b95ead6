"""The backend adapter: the only code that drives mlx-lm's BatchGenerator or touches mlx-lm's private state.

ModelBackend (one per engine) runs the model outside the decode batch: it probes which caches can be reused
and prefills shared prefixes for warm-ups. DecodeBatch (one per run) is continuous batching: rows go in as
RowSpec (a prompt suffix, the cached prefix it starts from, its sampler and logits processors), and every step
gives one RowOutput per row (its new tokens, the log-probabilities they were sampled from, whether it ended).
A backend that decodes several tokens per step, or attends to a shared prefix instead of copying it into each
row, implements the same calls. Checked for mlx-lm 0.32.2 (pinned exactly).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, GenerationBatch, _merge_caches, _right_pad_prompts, generation_stream
from mlx_lm.models.cache import BatchKVCache, _BaseCache, can_trim_prompt_cache, make_prompt_cache

from omlx_jobs.worker.attention import cpu_prefill
from omlx_jobs.worker.attention import ragged as attention
from omlx_jobs.worker.cache import kv
from omlx_jobs.worker.cache.prefix_cache import Entry, Match, PrefixCache

BaseCache = _BaseCache
"""mlx-lm's base of layer caches, for cache classes of ours (worker/cascade_cache.py)."""

Caches = list[Any]
Sampler = Callable[[mx.array], mx.array]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]
StepLogits = Callable[[mx.array, list[Any], list[int]], mx.array]
"""(the batch's logits, each row's batchable processor or None, each row's last token) -> logits: one call
per decode step for every row's batchable processor (worker/logits.py's BatchablePart: bias and grammar)."""

# Models whose __call__ is `project(model.model(x))` with nothing in between (checked for mlx-lm 0.32.2):
# for them a prefill runs the body alone and projects only the positions whose logits are wanted.
SPLIT_HEAD_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "mistral"})


@dataclass
class RowSpec:
    """One row to start: what it still has to compute, what it starts from, and how it samples."""

    prompt: list[int]
    """Prompt tokens not in `prefix` (at least one; for first_tokens, none)."""
    max_tokens: int
    prefix: Match | None = None
    """The first `prefix.length` positions of a prefix-cache entry, reused (DecodeBatch copies them into the row;
    a CascadeBatch references them)."""
    context: list[int] = field(default_factory=list)
    """The tokens before `prompt` (those in `prefix`): what logits processors see first."""
    sampler: Sampler | None = None
    """None: greedy, sampled for the whole batch in one call."""
    processors: list[LogitsProcessor] = field(default_factory=list)
    """Per-request logits processors (penalties, logprob tap, grammar and logit_bias), called as proc(tokens, logits);
    one marked `batchable` is applied for the whole batch in decode steps when `step_logits` is set."""
    logits: Any = None
    """first_tokens only: the logits after the last prompt token, cached."""


@dataclass(slots=True)
class RowOutput:
    """What one step produced for one row (one is made per row and step: slots keep that cheap)."""

    row: int
    tokens: list[int]
    """New tokens in order: one per step here, several for a multi-token backend."""
    logprobs: list[mx.array]
    """Per token, the log-softmax (after logits processors) it was sampled from: a lazy vector over the vocabulary."""
    finish: str | None
    """"stop": the last token ends the sequence (end-of-sequence); "length": max_tokens reached; None: going on."""


@dataclass(frozen=True)
class Timings:
    prefill_seconds: float = 0.0
    """In prompt processing of inserted rows (uncached suffixes, merging cached prefixes included)."""
    decode_seconds: float = 0.0


class Batch(Protocol):
    """What the engine asks of a decode batch: DecodeBatch here; a multi-token or a cascade batch later."""

    timings: Timings

    def insert(self, rows: Sequence[RowSpec]) -> list[int]: ...

    def step(self) -> list[RowOutput]: ...

    def remove(self, rows: Sequence[int]) -> None: ...

    def first_tokens(self, rows: Sequence[RowSpec]) -> list[RowOutput]: ...

    def close(self) -> Timings: ...


class ModelBackend:
    """The model, run outside a decode batch: cache probing and warm-up prefill."""

    def __init__(
        self, model: Any, *, eos: Sequence[int], batch_size: int, prefill_batch_size: int, prefill_step: int
    ) -> None:
        self.model = model
        self.eos = frozenset(eos)
        self.batch_size, self.prefill_batch_size, self.prefill_step = batch_size, prefill_batch_size, prefill_step
        probe = make_prompt_cache(model)
        self.trimmable = bool(can_trim_prompt_cache(probe))
        # Reuse needs caches BatchGenerator can merge; others fall back to no reuse.
        self.reusable = all(hasattr(c, "merge") for c in probe)
        cpu_prefill.install(model)  # on the CPU, prefill attention skips the masked half (worker/cpu_prefill.py)
        self.ragged = False
        self.cascade = False
        self.step_logits: StepLogits | None = None
        """Set by the engine: decode steps then apply processors marked `batchable` in one call for all rows."""

    def use_ragged_decode(self) -> bool:
        """Decode through worker/attention.py's kernel where it runs (CUDA) and the model allows; True if so."""
        self.ragged = attention.available() and attention.install(self.model)
        return self.ragged

    def before_admit(self, admissions: Sequence[Any], cache: Any, *, keep: bool) -> None:
        """Called with a window's admissions before they become rows: a vision backend computes their image
        positions then, together (worker/vision_engine.py). Text has nothing to do."""

    def use_cascade(self) -> bool:
        """Let rows reference their cached prefix instead of copying it (worker/cascade_batch.py) where the model's
        caches and attention allow; True if so. Call after use_ragged_decode (the cascade call wraps the ragged)."""
        from omlx_jobs.worker.attention import cascade

        self.cascade = cascade.eligible(self.model) and cascade.install(self.model)
        return self.cascade

    def open(self, cache: PrefixCache | None = None) -> Batch:
        """A decode batch for one run; close it when the run ends. With `cache` (the prefix cache rows start
        from) and use_cascade on, rows reference their prefix entries in it instead of copying them."""
        if self.cascade and cache is not None:
            from omlx_jobs.worker.backend.cascade_batch import CascadeBatch  # it builds on DecodeBatch

            return CascadeBatch(self, cache)
        return DecodeBatch(self)

    def prefill(
        self,
        bases: Sequence[Caches | None],
        suffixes: Sequence[list[int]],
        want: Sequence[set[int]],
        prompts: Sequence[Any] | None = None,
    ) -> list[tuple[Caches, dict[int, mx.array]]]:
        """Extend each base cache (None: empty) by its suffix, all in one batch. `prompts` are the Prompts the
        suffixes are cut from: a vision backend reads their images (worker/vision_engine.py); text ignores them.

        Returns, per sequence, its caches and the logits after each suffix position in `want` (0-based). Unequal
        lengths are right-padded as mlx-lm's PromptProcessingBatch does. Only wanted positions are projected onto
        the vocabulary where the model allows it: the rest of that work is wasted (a large share with big
        vocabularies).
        """
        with mx.stream(generation_stream):
            batch = _merge_caches([b if b is not None else make_prompt_cache(self.model) for b in bases])
            lengths = [len(s) for s in suffixes]
            longest = max(lengths)
            padding = [longest - n for n in lengths]
            tokens = _right_pad_prompts(list(suffixes), max_length=longest)
            if max(padding):
                for c in batch:
                    c.prepare(lengths=lengths, right_padding=padding)
            logits = self._run_prefill(batch, tokens, longest, want)
            if max(padding):
                for c in batch:
                    c.finalize()
            out = [[c.extract(i) for c in batch] for i in range(len(suffixes))]
            mx.eval([c.state for caches_i in out for c in caches_i])
        return list(zip(out, logits, strict=True))

    def _run_prefill(
        self, batch: Caches, tokens: mx.array, longest: int, want: Sequence[set[int]]
    ) -> list[dict[int, mx.array]]:
        project = _projection(self.model)
        run = self.model.model if project is not None else self.model
        logits: list[dict[int, mx.array]] = [{} for _ in want]
        for start in range(0, longest, self.prefill_step):
            n = min(self.prefill_step, longest - start)
            h = run(tokens[:, start : start + n], cache=batch)
            picks = [(i, j) for i, ws in enumerate(want) for j in sorted(ws) if start <= j < start + n]
            if picks:
                rows = mx.stack([h[i, j - start] for i, j in picks])
                rows = project(rows) if project is not None else rows
                for k, (i, j) in enumerate(picks):
                    logits[i][j] = rows[k : k + 1]
            mx.eval([c.state for c in batch], [v for d in logits for v in d.values()])
        return logits


def own_length(cache: BatchKVCache) -> int:
    """The positions a BatchKVCache holds (its rows end there, left-padded)."""
    return int(cache._idx)


def filter_own(cache: BatchKVCache, keep: list[int], shift: int | None) -> int:
    """BatchKVCache.filter (mlx-lm 0.32.2) with the left padding to drop given, or read from the device when None
    (what mlx-lm does for every layer); returns it. For worker/cascade_cache.py's own-suffix caches."""
    if cache.keys is not None:
        cache.keys, cache.values = cache.keys[keep], cache.values[keep]
    cache.offset = cache.offset[keep]
    cache.left_padding = cache.left_padding[keep]
    if shift is None:
        shift = min(cache.left_padding.tolist())
    if shift > 0:
        if cache.keys is not None:
            cache.keys, cache.values = cache.keys[..., shift:, :], cache.values[..., shift:, :]
        cache._idx -= shift
        cache.left_padding -= shift
    return shift


def _projection(model: Any) -> Callable[[mx.array], mx.array] | None:
    if getattr(model, "model_type", None) not in SPLIT_HEAD_MODEL_TYPES or not callable(getattr(model, "model", None)):
        return None
    if hasattr(model, "lm_head"):
        return model.lm_head
    return model.model.embed_tokens.as_linear


class DecodeBatch:
    """Continuous batching over mlx-lm's BatchGenerator, for one run: insert, step, remove, close."""

    def __init__(self, backend: ModelBackend) -> None:
        self.backend = backend
        self._closing = contextlib.ExitStack()  # undone in reverse by close(), each step even if one fails
        try:
            if backend.ragged:
                self._closing.enter_context(attention.enabled())
            gen = BatchGenerator(
                backend.model,
                stop_tokens=[[t] for t in sorted(backend.eos)],
                completion_batch_size=backend.batch_size,
                prefill_batch_size=backend.prefill_batch_size,
                prefill_step_size=backend.prefill_step,
            )
            self._closing.callback(gen.close)
            # mlx-lm copies each finished sequence's KV cache out to return it; nothing here uses it.
            gen._generation_batch.extract_cache = lambda idx: None
            if backend.step_logits is not None:  # the persistent batch every decode step runs in (mlx-lm 0.32.2)
                gen._generation_batch.__class__ = _BatchStepGeneration
                gen._generation_batch.step_logits = backend.step_logits
            self._stats = self._closing.enter_context(gen.stats())
        except BaseException:
            self._closing.close()
            raise
        self._gen = gen
        self._view: tuple[Entry, int, Caches] | None = None
        self.timings = Timings()

    def insert(self, rows: Sequence[RowSpec]) -> list[int]:
        """Queue rows for prompt processing; returns their row ids (the ids of their RowOutputs)."""
        return self._gen.insert(
            [r.prompt for r in rows],
            max_tokens=[r.max_tokens for r in rows],
            caches=[self._row_caches(r) for r in rows],
            all_tokens=[list(r.context) for r in rows],  # mlx-lm extends this list in place
            samplers=[r.sampler for r in rows],
            logits_processors=[r.processors for r in rows],
        )

    def step(self) -> list[RowOutput]:
        """One step: a decode step for the generating rows, and a chunk of prompt processing for new ones.

        A long prefill returns between chunks, so the caller can check for a stop request.
        """
        _, responses = self._gen.next()
        return [RowOutput(r.uid, [r.token], [r.logprobs], r.finish_reason) for r in responses]

    def remove(self, rows: Sequence[int]) -> None:
        """Stop rows early (a stop string ended them); rows already finished are ignored."""
        self._gen.remove(list(rows))

    def first_tokens(self, rows: Sequence[RowSpec]) -> list[RowOutput]:
        """Sample each row's first token from its cached `logits`, all read back at once (row ids are -1).

        One wait for the device per refill: one per request, while a decode step is in flight, cost more than it
        saved on a GPU.
        """
        sampled, logprobs = [], []
        for r in rows:
            logits = r.logits
            if r.processors:
                context = mx.array(r.context)
                for proc in r.processors:
                    logits = proc(context, logits)
            lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            sampled.append(r.sampler(lp) if r.sampler is not None else mx.argmax(lp, axis=-1))
            logprobs.append(lp)
        mx.eval(sampled)
        out = []
        for r, token, lp in zip(rows, sampled, logprobs, strict=True):
            t = int(token.item())
            finish = "stop" if t in self.backend.eos else "length" if r.max_tokens == 1 else None
            out.append(RowOutput(-1, [t], [lp[0]], finish))
        return out

    def close(self) -> Timings:
        """Release the batch (every clean-up step runs, even if one fails) and return where its time went."""
        self._view = None
        try:
            self._closing.close()
        finally:
            self.timings = Timings(self._stats.prompt_time, self._stats.decode_time)
        return self.timings

    def cache_nbytes(self) -> int:
        """Bytes the batch's KV caches hold (rows waiting, in prompt processing and decoding)."""
        return int(self._gen.prompt_cache_nbytes)

    def _row_caches(self, row: RowSpec) -> Caches | None:
        """A view of the row's prefix, reused across a group's consecutive admissions (they share one prefix)."""
        prefix = row.prefix
        if prefix is None:
            return None
        entry, length = prefix.entry, prefix.length
        if self._view is None or self._view[0] is not entry or self._view[1] != length:
            self._view = (entry, length, kv.view(entry.value, entry.tokens, length))
        return self._view[2]


class _BatchStepGeneration(GenerationBatch):  # type: ignore[misc]
    """mlx-lm 0.32.2's GenerationBatch step, except that processors marked `batchable` (grammar masks, logit_bias)
    are applied for the whole batch by one `step_logits` call after the per-row ones, the forward pass running
    meanwhile. A row's first token is sampled by mlx-lm's own step, row by row, with the same processors."""

    step_logits: StepLogits

    def _step(self) -> tuple[list[int], list[mx.array]]:
        self._current_tokens = self._next_tokens
        self._current_logprobs = self._next_logprobs
        inputs = self._current_tokens
        logits = self.model(inputs[:, None], cache=self.prompt_cache)[:, -1, :]
        parts = [next((p for p in ps or () if getattr(p, "batchable", False)), None) for ps in self.logits_processors]
        others = [
            [p for p in ps or () if p is not part] for ps, part in zip(self.logits_processors, parts, strict=True)
        ]
        token_context = []
        if any(others):  # row by row only where a row has a processor besides its batchable one
            rows = []
            for e in range(len(self.uids)):
                row_logits = logits[e : e + 1]
                if others[e]:  # as mlx-lm: only rows with (such) processors keep a context
                    context = self._token_context[e].update_and_fetch(inputs[e : e + 1])
                    token_context.append(context)
                    for processor in others[e]:
                        row_logits = processor(context, row_logits)
                rows.append(row_logits)
            logits = mx.concatenate(rows, axis=0)
        if any(p is not None for p in parts):
            mx.async_eval(logits)  # the forward pass runs while the masks are filled
            logits = self.step_logits(logits, parts, inputs.tolist())
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        samplers = [self.fallback_sampler if s is None else s for s in (self.samplers or [None] * len(self.uids))]
        if not samplers or all(s is samplers[0] for s in samplers):
            sampled = (samplers[0] if samplers else self.fallback_sampler)(logprobs)
        else:
            sampled = mx.concatenate([s(logprobs[e : e + 1]) for e, s in enumerate(samplers)], axis=0)
        self._next_tokens = sampled
        self._next_logprobs = list(logprobs)
        mx.async_eval(self._next_tokens, self._next_logprobs, token_context)
        mx.eval(inputs, self._current_logprobs)
        tokens = inputs.tolist()
        for sti, ti in zip(self.tokens, tokens, strict=True):
            sti.append(ti)
        return tokens, self._current_logprobs
