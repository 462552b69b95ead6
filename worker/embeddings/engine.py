"""The engine of an embedding model (engine/contract.EngineLike): each page of requests is planned, their items
embedded in length-sorted batches under a token budget (runner.py), and each request handed back as soon as its
last item is done, its vectors in the store's form. No sampling, no decode, no prefix cache kept between pages.

On a causal model, inputs of a page that share a prefix (an instruction, a common leading run) compute it once
(prefix.py groups them, reuse.py runs it): a request's cached_tokens counts its items' prefix positions not
computed for it, the first row of each group being charged the prefix (as worker/engine/charges.py does).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from omlx_jobs import defaults
from omlx_jobs.errors import ErrorCode
from omlx_jobs.jobs.params import OutputParams
from omlx_jobs.store.vectors import StoredVectors
from omlx_jobs.worker.cache.prefix_cache import PrefixCache
from omlx_jobs.worker.embeddings.batching import plan_batches
from omlx_jobs.worker.embeddings.model import EmbeddingModel, EmbeddingPrompt
from omlx_jobs.worker.embeddings.prefix import PrefixGroup, computed_tokens, prefix_groups
from omlx_jobs.worker.embeddings.reuse import REUSE_POOLINGS, Prefix, embed_suffixes, run_prefix
from omlx_jobs.worker.embeddings.runner import BatchRunner, finish
from omlx_jobs.worker.engine.config import EngineConfig
from omlx_jobs.worker.engine.contract import Control, Hooks, ResultsHook
from omlx_jobs.worker.engine.results import ItemResult, PlanTotals, RunStats, TokenCounters
from omlx_jobs.worker.engine.sequence import WorkItem
from omlx_jobs.worker.prompts import PromptError

PAGE_REQUESTS = 256
"""Requests planned together when the caller gives no page size."""


class EmbeddingEngine:
    """Runs embeddings requests on an EmbeddingModel (see the module docstring)."""

    def __init__(
        self,
        loaded: EmbeddingModel,
        config: EngineConfig | None = None,
        *,
        token_budget: int = defaults.EMBED_BATCH_TOKENS,
        max_rows: int = defaults.EMBED_BATCH_ROWS,
        pad_to: int | None = None,
    ) -> None:
        if loaded.forward is None:
            raise ValueError("an EmbeddingModel needs its forward pass")
        self.loaded, self.config = loaded, config or EngineConfig()
        self.cache = PrefixCache(max_bytes=0)  # nothing is kept between batches; the shard runner reads its stats
        pad = getattr(loaded.tokenizer, "pad_token_id", None)
        self.runner = BatchRunner(
            loaded.forward,
            loaded.embedding,
            pad_id=int(pad or 0),
            token_budget=token_budget,
            max_rows=max_rows,
            pad_to=pad_to if pad_to is not None else _device_pad_to(),
        )
        self.reuse = self.config.prefix_cache and loaded.causal and loaded.extend is not None
        self.reuse = self.reuse and loaded.embedding.pooling in REUSE_POOLINGS
        """Shared prefixes run once (reuse.py): on a causal model whose caches copy per row, pooled by last token
        or mean, unless the engine's prefix cache is off."""
        self._prefix: Prefix | None = None
        """The computed prefix of the group being embedded."""
        self.live = TokenCounters()

    def check(self, tokens: Sequence[int], params: Any, output: OutputParams | None = None) -> None:
        """Every item was checked as its prompt was built (model.EmbeddingModel.prompt); an embeddings request
        asks for nothing else."""
        if not tokens:
            raise PromptError(ErrorCode.INVALID_PROMPT, "the request has no tokens to embed")

    def reset(self) -> None:
        """Nothing is kept between runs."""

    def run(self, items: Iterable[WorkItem], hooks: Hooks | ResultsHook, *, page_size: int | None = None) -> RunStats:
        """Embed every item, a page of requests at a time; stops between batches when hooks.control says so."""
        started, hooks, source = time.perf_counter(), Hooks.of(hooks), iter(items)
        stats = RunStats()
        while True:
            if hooks.control() is not Control.RUN:
                stats.input_exhausted = False
                break
            page = list(itertools.islice(source, page_size or PAGE_REQUESTS))
            if not page:
                break
            if not self._page(page, hooks, stats):
                stats.input_exhausted = False
                break
        stats.seconds = time.perf_counter() - started
        self.live.observe(stats, 0, 0)
        return stats

    def _page(self, page: list[WorkItem], hooks: Hooks, stats: RunStats) -> bool:
        """Embed one page of requests; False if the caller stopped it (its unfinished keys are in stats)."""
        prompts = [_embedding_prompt(w) for w in page]
        flat = [(r, i) for r, p in enumerate(prompts) for i in range(len(p.items))]
        rows = [prompts[r].items[i] for r, i in flat]
        starts = [prompts[r].starts[i] if prompts[r].starts else 0 for r, i in flat]
        groups = self._groups(rows)
        total, computed = sum(len(p.tokens) for p in prompts), computed_tokens(rows, groups)
        stats.prompt_tokens += total
        stats.trie_min_tokens += computed
        if hooks.plan is not None:
            hooks.plan(PlanTotals(prompt_tokens=total, trie_min_tokens=computed))
        if hooks.admit is not None:
            hooks.admit([w.key for w in page])
        begun = time.time()
        left = [len(p.items) for p in prompts]
        cached = [0] * len(prompts)
        vectors: list[list[np.ndarray | None]] = [[None] * len(p.items) for p in prompts]
        stats.peak_live_items = max(stats.peak_live_items, len(page))
        for group, batch, first, last in self._batches(rows, groups):
            if hooks.control() is not Control.RUN:
                stats.unfinished.extend(w.key for r, w in enumerate(page) if left[r] > 0)
                return False
            tick = time.perf_counter()
            pooled = self._embed(rows, starts, group, batch, first, last)
            stats.prefill_seconds += time.perf_counter() - tick
            stats.prefill_tokens += sum(len(rows[j]) - group.prefix for j in batch) + (group.prefix if first else 0)
            done = []
            for row, j in enumerate(batch):
                r, i = flat[j]
                vectors[r][i] = pooled[row]
                cached[r] += 0 if first and row == 0 else group.prefix  # the prefix is charged to its first row
                left[r] -= 1
                if left[r] == 0:
                    done.append(self._result(page[r], prompts[r], vectors[r], begun, cached[r]))
            self.live.observe(stats, 0, sum(1 for n in left if n))
            if done:
                hooks.results(done)
        return True

    def _groups(self, rows: Sequence[Sequence[int]]) -> list[PrefixGroup]:
        """Inputs by shared prefix where reusing one is exact and on; otherwise one group of prefix 0."""
        if not self.reuse:
            return [PrefixGroup(0, list(range(len(rows))))]
        return prefix_groups(rows, self.config.min_shared_tokens)

    def _batches(
        self, rows: Sequence[Sequence[int]], groups: Sequence[PrefixGroup]
    ) -> Iterator[tuple[PrefixGroup, list[int], bool, bool]]:
        """Each group's members in length-sorted batches of their own suffixes under the token budget: (group,
        batch of row indices, whether it is the group's first batch, and its last)."""
        for group in groups:
            step = self.runner.pad_to  # planned at their padded lengths: a length bucket gets one row count
            own = [-(-(len(rows[j]) - group.prefix) // step) * step for j in group.members]
            batches = plan_batches(own, self.runner.token_budget, self.runner.max_rows)
            for n, batch in enumerate(batches):
                yield group, [group.members[k] for k in batch], n == 0, n == len(batches) - 1

    def _embed(
        self,
        rows: Sequence[Sequence[int]],
        starts: list[int],
        group: PrefixGroup,
        batch: list[int],
        first: bool,
        last: bool,
    ) -> np.ndarray:
        """Pooled vectors of one batch: whole rows, or the group's suffixes from its prefix (run at its first
        batch, dropped after its last)."""
        if not group.prefix:
            return self.runner.embed_batch([rows[j] for j in batch], [starts[j] for j in batch])
        loaded = self.loaded
        assert loaded.extend is not None and loaded.new_cache is not None
        if first or self._prefix is None:
            self._prefix = run_prefix(loaded.extend, loaded.new_cache, rows[batch[0]][: group.prefix])
        pooled, padded = embed_suffixes(
            loaded.extend,
            loaded.new_cache,
            self._prefix,
            [rows[j][group.prefix :] for j in batch],
            loaded.embedding.pooling,
            starts=[starts[j] for j in batch],
            pad_id=self.runner.pad_id,
            pad_to=self.runner.pad_to,
        )
        self.runner.padded_tokens += padded + (group.prefix if first else 0)
        if last:
            self._prefix = None
        return pooled

    def _result(
        self, work: WorkItem, prompt: EmbeddingPrompt, vectors: list[Any], begun: float, cached: int
    ) -> ItemResult:
        out = finish(np.stack(vectors), self.loaded.embedding.normalize, prompt.dimensions)
        stored = StoredVectors.from_bytes(out.shape[0], out.shape[1], out.astype("<f4").tobytes(), base64=prompt.base64)
        return ItemResult(work.key, [], len(prompt.tokens), cached, begun, time.time(), vectors=stored.encode())


def _embedding_prompt(work: WorkItem) -> EmbeddingPrompt:
    if not isinstance(work.prompt, EmbeddingPrompt):  # a plain token list: one item (tests, benches)
        return EmbeddingPrompt(work.tokens, work.prompt.key, (), (tuple(work.tokens),))
    return work.prompt


def _device_pad_to() -> int:
    """Padded lengths rounded up to a multiple of this: on CUDA, where each new attention shape builds a cuDNN
    plan (an LRU of 256 by default), so that varied lengths reuse a few dozen plans; elsewhere exact lengths."""
    return defaults.EMBED_PAD_TO_CUDA if mx.cuda.is_available() and mx.default_device() == mx.gpu else 1
