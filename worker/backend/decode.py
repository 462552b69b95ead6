"""Continuous batching over mlx-lm's BatchGenerator, for one run: insert rows, step, remove, close.

Rows go in as RowSpec (a prompt suffix, the cached prefix it starts from, its sampler and logits processors), and
every step gives one RowOutput per row (its new tokens, the log-probabilities they were sampled from, whether it
ended). Each step runs the model inside the backend's attention routing (attention/routing.py). Rows may verify
drafted tokens in the same step (speculative.py) and then give several tokens. A batch that attends to a shared
prefix instead of copying it into each row (cascade_batch.py) implements the same calls.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, GenerationBatch, greedy_sampler

from omlx_jobs.errors import FinishReason
from omlx_jobs.worker.attention import routing
from omlx_jobs.worker.attention.options import Routing
from omlx_jobs.worker.backend.rows import Caches, RowOutput, RowSpec, StepLogits, Timings
from omlx_jobs.worker.backend.speculative import SpecResponse, SpeculativeSteps
from omlx_jobs.worker.cache import kv
from omlx_jobs.worker.cache.prefix_cache import Entry
from omlx_jobs.worker.speculation.controller import Figures, Speculation


class BatchOwner(Protocol):
    """What a decode batch reads of the backend that opens it (model.ModelBackend)."""

    model: Any
    eos: frozenset[int]
    batch_size: int
    prefill_batch_size: int
    prefill_step: int
    prefill_tokens: int
    refill_rows: int
    step_logits: StepLogits | None
    routing: Routing
    speculative: bool


class DecodeBatch:
    """Continuous batching over mlx-lm's BatchGenerator, for one run: insert, step, remove, close."""

    def __init__(self, backend: BatchOwner) -> None:
        self.backend = backend
        self._closing = contextlib.ExitStack()  # undone in reverse by close(), each step even if one fails
        try:
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
                speculative = backend.speculative
                gen._generation_batch.__class__ = _SpeculativeGeneration if speculative else _BatchStepGeneration
                gen._generation_batch.step_logits = backend.step_logits
                if speculative:
                    gen._generation_batch.speculation = Speculation()
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
        gen, b = self._gen, self.backend
        if gen._unprocessed_sequences:  # mlx-lm takes at most prefill_batch_size of them into its prompt pass
            refill = len(gen._prompt_batch) or refill_now(len(gen._generation_batch), b.batch_size, b.refill_rows)
            gen.prefill_batch_size = (
                0
                if not refill
                else prefill_rows(
                    gen._unprocessed_sequences, rows=b.prefill_batch_size, tokens=b.prefill_tokens, step=b.prefill_step
                )
            )
        with routing.active(self.backend.routing):  # the model runs in here (decode and prompt processing)
            _, responses = gen.next()
        return [
            RowOutput(r.uid, r.tokens, r.token_logprobs, r.finish_reason)
            if type(r) is SpecResponse
            else RowOutput(r.uid, [r.token], [r.logprobs], r.finish_reason)
            for r in responses
        ]

    @property
    def speculation(self) -> Figures | None:
        """What speculative decoding did in this batch (None: off)."""
        spec = getattr(self._gen._generation_batch, "speculation", None)
        return spec.figures if spec is not None else None

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
            finish = FinishReason.STOP if t in self.backend.eos else FinishReason.LENGTH if r.max_tokens == 1 else None
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


def refill_now(decoding: int, batch: int, refill_rows: int) -> bool:
    """Whether a batch decoding `decoding` of `batch` rows takes queued rows now: at once when under half full,
    else only once `refill_rows` are free (each refill is a prompt pass that stalls every decoding row)."""
    return decoding * 2 < batch or batch - decoding >= refill_rows


def prefill_rows(queue: Iterable[Any], *, rows: int, tokens: int, step: int) -> int:
    """Rows the next prompt pass may take from BatchGenerator's queue of sequences (uid, prompt segments, ...):
    at least `rows`, and more while rows x the longest row's first chunk (at most `step` tokens) fits `tokens`.

    A prompt pass stalls the whole decode batch, and on a GPU it costs about the same for 8 rows as for 32 when
    the rows are a prefix group's short suffixes (bench/engine/step_trace.py): fewer, fuller passes win."""
    n = longest = 0
    for seq in queue:
        longest = max(longest, min(step, sum(len(s) for s in seq[1])))
        if (n + 1) * longest > tokens:
            break
        n += 1
    return max(rows, n)


class _BatchStepGeneration(GenerationBatch):  # type: ignore[misc]
    """mlx-lm 0.32.2's GenerationBatch step, except:
    - processors marked `batchable` (grammar masks, logit_bias) are applied for the whole batch by one
      `step_logits` call after the per-row ones, the forward pass running meanwhile; a row's first token is
      sampled by mlx-lm's own step, row by row, with the same processors;
    - when every row is greedy, the token is the argmax of the logits and the log-softmax is left lazy: only a
      request that asks for logprobs evaluates it (outputs.py). mlx-lm normalizes every step, and on the CPU
      (mlx 0.32.4) `logsumexp` over 64 x 49,152 logits costs as much as a third of SmolLM2's decode step
      (bench/engine/step_overhead.py)."""

    step_logits: StepLogits
    lazy_logprobs = True
    """False: normalize every step as mlx-lm does (bench/engine/step_overhead.py compares the two)."""

    def _step(self) -> tuple[list[int], list[mx.array]]:
        self._current_tokens = self._next_tokens
        self._current_logprobs = self._next_logprobs
        inputs = self._current_tokens
        logits = self.model(inputs[:, None], cache=self.prompt_cache)[:, -1, :]
        sampled, logprobs, token_context = self._sample(logits, inputs)
        lazy = self._lazy()
        self._next_tokens = sampled
        self._next_logprobs = list(logprobs)
        mx.async_eval(self._next_tokens, [] if lazy else self._next_logprobs, token_context)
        mx.eval(inputs, [] if lazy else self._current_logprobs)
        tokens = inputs.tolist()
        for sti, ti in zip(self.tokens, tokens, strict=True):
            sti.append(ti)
        return tokens, self._current_logprobs

    def _sample(self, logits: mx.array, inputs: mx.array) -> tuple[mx.array, mx.array, list[mx.array]]:
        """Each row's processors, then the batchable ones in one call, then the samplers: (tokens, logprobs,
        the token contexts updated). `inputs`: each row's token the logits follow."""
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
        samplers = self._samplers()
        if self._lazy():  # argmax(logits) is argmax(logprobs): the normalization waits until someone asks for it
            sampled = mx.argmax(logits, axis=-1)
        elif not samplers or all(s is samplers[0] for s in samplers):
            sampled = (samplers[0] if samplers else self.fallback_sampler)(logprobs)
        else:
            sampled = mx.concatenate([s(logprobs[e : e + 1]) for e, s in enumerate(samplers)], axis=0)
        return sampled, logprobs, token_context

    def _samplers(self) -> list[Any]:
        return [self.fallback_sampler if s is None else s for s in (self.samplers or [None] * len(self.uids))]

    def _lazy(self) -> bool:
        """Every row greedy: the token is the logits' argmax, and the log-softmax stays lazy (evaluated only for
        requests that ask for logprobs)."""
        return self.lazy_logprobs and all(s is greedy_sampler for s in self._samplers())


class _SpeculativeGeneration(SpeculativeSteps, _BatchStepGeneration):
    """_BatchStepGeneration with speculative verification steps (speculative.py)."""
