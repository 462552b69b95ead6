"""Speculative decode steps in the batch: rows with drafts verify them in the same forward pass as the rest.

SpeculativeSteps is mixed into the decode batch's GenerationBatch (decode.py; mlx-lm 0.32.2 keeps one
"pending" token per row, sampled and not yet fed). Each step it asks the batch's Speculation
(worker/speculation/) for drafts: only rows without logits processors (grammar, logit_bias, penalties,
logprobs taps) whose sampler is greedy or shared (seeded rows are never speculated) draft, and only while their
controller says it pays. With no drafts the step is mlx-lm's, pipelined. Otherwise one forward pass runs W =
1 + the longest draft positions per row: the pending token, then the drafts (shorter rows padded). Rows without
drafts take their token from position 0, through the same processing as a plain step; rows with drafts keep the
accepted prefix and the model's own token after it (worker/speculation/verify.py), and every row gives its
unused positions back (rollback.py). A step then emits one or more tokens per row, with the log-probabilities
they were drawn from, stopping at end-of-sequence or max_tokens inside a draft.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.generate import GenerationBatch

from omlx_jobs.errors import FinishReason
from omlx_jobs.worker.backend import rollback
from omlx_jobs.worker.speculation import verify
from omlx_jobs.worker.speculation.controller import Speculation


@dataclass
class SpecResponse(GenerationBatch.Response):  # type: ignore[misc]
    """A row's tokens of one verification step (at least one), each with its log-probabilities."""

    tokens: list[int] = field(default_factory=list)
    token_logprobs: list[mx.array] = field(default_factory=list)


def speculable(sampler: Any, greedy: Any) -> str | None:
    """'greedy', 'sampled' or None (the row's sampler cannot be verified against: seeded or unknown)."""
    if sampler is None or sampler is greedy:
        return "greedy"
    return "sampled" if hasattr(sampler, "filtered") else None


class SpeculativeSteps:
    """Mixed in before a GenerationBatch subclass that has `_sample(logits, inputs)` (decode.py)."""

    speculation: Speculation
    _plain_before = False
    """Whether the last step was plain too: only then does a plain step's time measure one whole step."""

    def next(self) -> list[Any]:
        if not self.uids:
            return []
        plan = self._plan()
        spec = self.speculation
        spec.step += 1
        if plan is None:
            tic = time.perf_counter()
            responses = super().next()  # type: ignore[misc]
            if self._plain_before:
                spec.costs.observe(1, time.perf_counter() - tic)
            self._plain_before = True
            spec.figures.plain_steps += 1
            return responses
        self._plain_before = False
        return self._verify(*plan)

    def _plan(self) -> tuple[list[int], list[list[int]]] | None:
        """Each row's pending token and drafts, or None when no row drafts this step."""
        spec = self.speculation
        wants = []
        for i, uid in enumerate(self.uids):
            k = 0
            if not self.logits_processors[i] and speculable(self.samplers[i], self.fallback_sampler):
                k = min(spec.wants(uid), self.max_tokens[i] - self._num_tokens[i] - 1)
            wants.append(k)
        if not any(k > 0 for k in wants) or not rollback.supported(self.prompt_cache):
            return None
        if len(spec.rows) > 2 * len(self.uids):
            spec.forget(self.uids)
        pending = self._next_tokens.tolist()
        drafts = [
            spec.draft(uid, self.tokens[i], pending[i], k) if k > 0 else []
            for i, (uid, k) in enumerate(zip(self.uids, wants, strict=True))
        ]
        return (pending, drafts) if any(drafts) else None

    def _verify(self, pending: list[int], drafts: list[list[int]]) -> list[Any]:
        tic = time.perf_counter()
        width = 1 + max(len(d) for d in drafts)
        rows = [[pending[i], *d] + [pending[i]] * (width - 1 - len(d)) for i, d in enumerate(drafts)]
        logits = self.model(mx.array(rows, dtype=mx.uint32), cache=self.prompt_cache)
        first, first_logprobs, context = self._sample(logits[:, 0, :], self._next_tokens)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        argmax = mx.argmax(logprobs, axis=-1)
        mx.eval(first, argmax, first_logprobs, context)
        firsts, argmaxes = first.tolist(), argmax.tolist()
        kept, nxt, nxt_logprobs, emitted, emitted_logprobs = [], [], [], [], []
        for i, d in enumerate(drafts):
            if not d:
                a, token, lp = 0, firsts[i], first_logprobs[i]
            else:
                if speculable(self.samplers[i], self.fallback_sampler) == "greedy":
                    v = verify.greedy(d, argmaxes[i][: len(d) + 1])
                else:
                    v = verify.sampled(d, logprobs[i], self.samplers[i].filtered)
                a, token, lp = v.accepted, v.token, logprobs[i, v.accepted]
            kept.append(a)
            nxt.append(token)
            nxt_logprobs.append(lp)
            emitted.append([pending[i], *d[:a]])
            emitted_logprobs.append([self._next_logprobs[i], *(logprobs[i, j] for j in range(a))])
        rollback.roll_back(self.prompt_cache, [width - 1 - a for a in kept])
        self._next_tokens = mx.array(nxt, dtype=mx.uint32)
        self._next_logprobs = nxt_logprobs
        mx.async_eval(self._next_tokens, self._next_logprobs, [c.state for c in self.prompt_cache])
        for sti, toks in zip(self.tokens, emitted, strict=True):
            sti.extend(toks)
        self._account(drafts, kept, width, time.perf_counter() - tic)
        return self._respond(emitted, emitted_logprobs)

    def _account(self, drafts: list[list[int]], kept: list[int], width: int, seconds: float) -> None:
        spec = self.speculation
        spec.costs.observe(width, seconds)
        spec.figures.verify_steps += 1
        drafting = sum(1 for d in drafts if d)
        charge = spec.costs.charges(width, len(drafts), drafting)
        for uid, d, a in zip(self.uids, drafts, kept, strict=True):
            if d:
                spec.record(uid, len(d), a, charge)

    def _respond(self, emitted: list[list[int]], emitted_logprobs: list[list[mx.array]]) -> list[Any]:
        """One response per row, as GenerationBatch.next, its tokens cut at end-of-sequence or max_tokens."""
        keep, responses = [], []
        for i, toks in enumerate(emitted):
            finish, out = None, []
            for t in toks:
                out.append(t)
                self._num_tokens[i] += 1
                if self._num_tokens[i] >= self.max_tokens[i]:
                    finish = FinishReason.LENGTH
                if self._matchers[i].advance(t):
                    finish = FinishReason.STOP
                if finish is not None:
                    break
            lps = emitted_logprobs[i][: len(out)]
            responses.append(SpecResponse(self.uids[i], out[-1], lps[-1], finish, None, None, out, lps))
            if finish is None:
                keep.append(i)
            else:
                self.speculation.rows.pop(self.uids[i], None)
        if len(keep) < len(self.uids):
            self.filter(keep)
        return responses
