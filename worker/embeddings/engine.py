"""The engine of an embedding model (engine/contract.EngineLike): each page of requests is planned, their items
embedded in length-sorted batches under a token budget (runner.py), and each request handed back as soon as its
last item is done, its vectors in the store's form. No sampling, no decode, no prefix cache.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from omlx_jobs import defaults
from omlx_jobs.errors import ErrorCode
from omlx_jobs.jobs.params import OutputParams
from omlx_jobs.store.vectors import StoredVectors
from omlx_jobs.worker.cache.prefix_cache import PrefixCache
from omlx_jobs.worker.embeddings.batching import plan_batches
from omlx_jobs.worker.embeddings.model import EmbeddingModel, EmbeddingPrompt
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
    ) -> None:
        if loaded.forward is None:
            raise ValueError("an EmbeddingModel needs its forward pass")
        self.loaded, self.config = loaded, config or EngineConfig()
        self.cache = PrefixCache(max_bytes=0)  # nothing is kept between batches; the shard runner reads its stats
        pad = getattr(loaded.tokenizer, "pad_token_id", None)
        self.runner = BatchRunner(
            loaded.forward, loaded.embedding, pad_id=int(pad or 0), token_budget=token_budget, max_rows=max_rows
        )
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
        total = sum(len(p.tokens) for p in prompts)
        stats.prompt_tokens += total
        stats.trie_min_tokens += total
        if hooks.plan is not None:
            hooks.plan(PlanTotals(prompt_tokens=total, trie_min_tokens=total))
        if hooks.admit is not None:
            hooks.admit([w.key for w in page])
        begun = time.time()
        flat = [(r, i) for r, p in enumerate(prompts) for i in range(len(p.items))]
        rows = [prompts[r].items[i] for r, i in flat]
        left = [len(p.items) for p in prompts]
        vectors: list[list[np.ndarray | None]] = [[None] * len(p.items) for p in prompts]
        stats.peak_live_items = max(stats.peak_live_items, len(page))
        for batch in plan_batches([len(t) for t in rows], self.runner.token_budget, self.runner.max_rows):
            if hooks.control() is not Control.RUN:
                stats.unfinished.extend(w.key for r, w in enumerate(page) if left[r] > 0)
                return False
            tick = time.perf_counter()
            pooled = self.runner.embed_batch([rows[j] for j in batch])
            stats.prefill_seconds += time.perf_counter() - tick
            stats.prefill_tokens += sum(len(rows[j]) for j in batch)
            done = []
            for row, j in enumerate(batch):
                r, i = flat[j]
                vectors[r][i] = pooled[row]
                left[r] -= 1
                if left[r] == 0:
                    done.append(self._result(page[r], prompts[r], vectors[r], begun))
            self.live.observe(stats, 0, sum(1 for n in left if n))
            if done:
                hooks.results(done)
        return True

    def _result(self, work: WorkItem, prompt: EmbeddingPrompt, vectors: list[Any], begun: float) -> ItemResult:
        out = finish(np.stack(vectors), self.loaded.embedding.normalize, prompt.dimensions)
        stored = StoredVectors.from_bytes(out.shape[0], out.shape[1], out.astype("<f4").tobytes(), base64=prompt.base64)
        return ItemResult(work.key, [], len(prompt.tokens), 0, begun, time.time(), vectors=stored.encode())


def _embedding_prompt(work: WorkItem) -> EmbeddingPrompt:
    if not isinstance(work.prompt, EmbeddingPrompt):  # a plain token list: one item (tests, benches)
        return EmbeddingPrompt(work.tokens, work.prompt.key, (), (tuple(work.tokens),))
    return work.prompt
