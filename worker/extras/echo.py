"""Echo's prompt logprobs in the engine: kept per prompt, computed in batched passes that continue the cache.

The decision for the prefix cache (issue 12, phase 1, worker/extras/prompt_logprobs.py): keep per-position logprobs
with cached prefixes rather than recompute them. Here that means:
- a warm-up of a window whose requests want prompt logprobs scores its prefix as it prefills it (`warm`), and
  its scores are kept (`PromptScores`, by prompt key) beside its cache entry, which keeps the logits after it;
- before a window's requests are admitted, `prepare` scores their prompts in one pass per cached prefix: only
  each prompt's own suffix runs, its first token scored from the entry's logits (4 answers to one question are
  one pass over 4 short rows);
- `score` gives a request its scores: kept ones, else whatever is left, continuing the longest usable prefix.
A scoring job then computes about its trie minimum (bench/RESULTS.md, issue 12).
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache

from omlx_jobs.worker.attention import routing
from omlx_jobs.worker.attention.options import Routing
from omlx_jobs.worker.cache import kv
from omlx_jobs.worker.cache.prefix_cache import Match, PrefixCache
from omlx_jobs.worker.extras.prompt_logprobs import PromptLogprobs, prompt_logprobs
from omlx_jobs.worker.prompts import Prompt, common_prefix

log = logging.getLogger(__name__)

PROMPT_SCORE_ENTRIES = 512
"""Scored prompts kept (about 48 bytes per token each); the most recently used stay."""


class PromptScores:
    """Per-position prompt logprobs of recently scored prompts, by prompt key, least recently used out."""

    def __init__(self, max_entries: int = PROMPT_SCORE_ENTRIES) -> None:
        self.max_entries = max_entries
        self._entries: collections.OrderedDict[bytes, PromptLogprobs] = collections.OrderedDict()

    def get(self, key: bytes) -> PromptLogprobs | None:
        return self._entries.get(key)

    def longest(self, key: bytes) -> tuple[PromptLogprobs, int] | None:
        """The kept scores sharing the longest prefix with `key`, and how many positions they share."""
        exact = self._entries.get(key)
        if exact is not None:
            return exact, len(exact)
        best: tuple[bytes, int] | None = None
        for k in self._entries:
            shared = common_prefix(k, key)
            if shared and (best is None or shared > best[1]):
                best = (k, shared)
        if best is None:
            return None
        self._entries.move_to_end(best[0])
        return self._entries[best[0]], best[1]

    def add(self, key: bytes, scores: PromptLogprobs) -> None:
        self._entries[key] = scores
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)


class EchoScorer:
    """Prompt logprobs for echo: the kept scores, and the model passes that compute the missing ones."""

    def __init__(self, model: Any, cache: PrefixCache, routing: Routing | None = None) -> None:
        self.model, self.cache = model, cache
        self.routing = routing or Routing()
        """The attention routing its passes run by (the backend's prefill routing)."""
        self.scores = PromptScores()
        self.tokens_run = 0
        """Prompt tokens run through the model by request scoring (warm-ups count their own)."""
        self._owed: dict[bytes, int] = {}  # tokens `prepare` ran for a prompt, charged when it is admitted
        self._plain_kv: bool | None = None

    @property
    def usable(self) -> bool:
        """Whether the model's caches are plain KVCache layers, which scoring passes can continue and cut."""
        if self._plain_kv is None:
            self._plain_kv = all(isinstance(c, KVCache) for c in make_prompt_cache(self.model))
        return self._plain_kv

    # ---- warm-ups ------------------------------------------------------------------------------------------

    def warm(self, tasks: Sequence[tuple[bytes, Sequence[int], Match | None]]) -> list[tuple[list[Any], mx.array, int]]:
        """Warm-up prefills that keep their scores; per (key, prefix tokens, base): its caches, the logits after
        it, and the tokens run. A base is continued when its scores and the logits after it are kept; the
        others run whole, all in one batched pass."""
        out: list[Any] = [None] * len(tasks)
        whole = []
        for i, (key, tokens, base) in enumerate(tasks):
            known = self.scores.longest(key)
            s = base.length if base is not None else 0
            if base is None or known is None or not known[1] >= s == base.entry.tokens or base.entry.logits is None:
                whole.append(i)
                continue
            prefix = (kv.view(base.entry.value, base.entry.tokens, s), base.entry.logits)
            ((rest, last, caches),) = self._passes([list(tokens[s:])], prefix=prefix, return_caches=True)
            self.scores.add(key, known[0].head(s).concat(rest))
            out[i] = (caches, last, len(tokens) - s)
        if whole:
            runs = self._passes([list(tasks[i][1]) for i in whole], return_caches=True)
            for i, (scores, last, caches) in zip(whole, runs, strict=True):
                self.scores.add(tasks[i][0], scores)
                out[i] = (caches, last, len(tasks[i][1]))
        return out

    # ---- requests ------------------------------------------------------------------------------------------

    def prepare(self, prompts: Sequence[Prompt]) -> None:
        """Score a window's prompts ahead of admission, one batched pass per scored cache entry they continue."""
        groups: dict[tuple[int, int], tuple[Match, PromptLogprobs, dict[bytes, Prompt]]] = {}
        for p in prompts:
            known = self.scores.longest(p.key)
            if known is None or known[1] >= len(p):
                continue
            match = self._scored_entry(p, known[1])
            if match is not None:
                groups.setdefault((id(match.entry), match.length), (match, known[0], {}))[2][p.key] = p
        for match, known, todo in groups.values():
            caches = kv.view(match.entry.value, match.entry.tokens, match.length)
            rows = list(todo.values())
            runs = self._passes([p.tokens[match.length :] for p in rows], prefix=(caches, match.entry.logits))
            for p, (rest, _, _) in zip(rows, runs, strict=True):
                self.scores.add(p.key, known.head(match.length).concat(rest))
                self._owed[p.key] = len(p) - match.length

    def score(self, prompt: Prompt) -> PromptLogprobs:
        """The prompt's per-position logprobs, computing only what is neither kept nor in the cache.

        Kept scores cover positions up to S (shared tokens). A pass continues the prefix cache's KV: of S tokens
        when an entry ends there with its logits (they score the next token), else of B <= S - 1 tokens (position
        B's score is kept); without either, the whole prompt runs.
        """
        n, known = len(prompt), self.scores.longest(prompt.key)
        if known is not None and known[1] >= n:
            self.tokens_run += self._owed.pop(prompt.key, 0)
            return known[0].head(n)
        scored = self._continue(prompt, known) if known is not None else None
        if scored is None:
            scored = self._run(prompt.tokens, None)
        self.scores.add(prompt.key, scored)
        return scored

    def _continue(self, prompt: Prompt, known: tuple[PromptLogprobs, int]) -> PromptLogprobs | None:
        scores, shared = known
        exact = self._scored_entry(prompt, shared)
        try:
            if exact is not None:
                caches = kv.view(exact.entry.value, exact.entry.tokens, exact.length)
                return scores.head(shared).concat(self._run(prompt.tokens[shared:], caches, exact.entry.logits))
            match = self.cache.lookup(prompt.key, limit=shared - 1, count=False) if shared > 1 else None
            if match is None or match.length < 1:
                return None
            b = match.length
            rest = self._run(prompt.tokens[b:], kv.view(match.entry.value, match.entry.tokens, b))
            return scores.head(b + 1).concat(rest.tail(1))
        except ValueError as exc:  # caches a scoring pass cannot continue (not KVCache): the whole prompt
            log.info("prompt logprobs without the cached prefix: %s", exc)
            return None

    def _scored_entry(self, prompt: Prompt, shared: int) -> Match | None:
        """A cache entry ending exactly at `shared` tokens with the logits after it, if there is one."""
        if shared >= len(prompt):
            return None
        match = self.cache.lookup(prompt.key, limit=shared, count=False)
        if match is None or not match.length == match.entry.tokens == shared or match.entry.logits is None:
            return None
        return match

    def _passes(self, *args: Any, **kwargs: Any) -> list[Any]:
        """prompt_logprobs through this model, by the backend's attention routing."""
        with routing.active(self.routing):
            return prompt_logprobs(self.model, *args, **kwargs)

    def _run(self, tokens: Sequence[int], caches: list[Any] | None, logits: Any = None) -> PromptLogprobs:
        prefix = (caches, logits) if caches is not None else None
        ((scores, _, _),) = self._passes([list(tokens)], prefix=prefix)
        self.tokens_run += len(tokens)
        return scores
