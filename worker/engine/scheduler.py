"""The scheduler: which sequences to admit next, and which shared prefixes to warm up before them. Pure: no MLX.

Work arrives as an iterable of items, read a page at a time: a page is planned (planner.plan: depth-first order,
warm-up points) when the planned queue runs shorter than a window, so the batch stays full across page
boundaries and a shard never has to be read or tokenized whole (page_size None reads it all at once).
Positions count admissions over the whole run. Each warm-up says how long its prefix is needed: from the window
before its group's first position to its last (`WarmUp.last`), the lifetime that lifetimes.py then enforces.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from omlx_jobs.worker.engine import planner
from omlx_jobs.worker.engine.results import PlanTotals
from omlx_jobs.worker.engine.sequence import WorkItem
from omlx_jobs.worker.prompts import Prompt

NO_WARMUPS = 1 << 30
"""A min_shared_tokens no prefix reaches: plan() then only counts (input order, no reuse)."""


@dataclass(frozen=True)
class Admission:
    """One sequence to start: choice `choice` of item number `item` (counted over the run) at `position`."""

    position: int
    item: int
    choice: int
    work: WorkItem


@dataclass(frozen=True)
class Warmup:
    """Prefill `node.depth` positions of `prompt` once; its group is admitted at positions node.first..node.last."""

    node: planner.WarmUp
    prompt: Prompt

    @property
    def key(self) -> bytes:
        return self.prompt.prefix_key(self.node.depth)


@dataclass(frozen=True)
class Window:
    """What to do before the next step: warm these prefixes up, then admit these sequences in order."""

    warmups: list[Warmup]
    admissions: list[Admission]


class Scheduler:
    """Admission order and warm-up scheduling over a run's items, planned page by page."""

    def __init__(
        self,
        items: Iterable[WorkItem],
        *,
        window: int,
        reuse: bool,
        min_shared_tokens: int,
        page_size: int | None = None,
        on_page: Callable[[PlanTotals], None] | None = None,
    ) -> None:
        if window < 1 or (page_size is not None and page_size < 1):
            raise ValueError("the window and the page size must be at least 1")
        self.window, self.reuse, self.min_shared_tokens = window, reuse, min_shared_tokens
        self.page_size, self.on_page = page_size, on_page
        self._input: Iterator[WorkItem] | None = iter(items)
        self._queue: deque[Admission] = deque()  # planned, not yet admitted, in position order
        self._warmups: deque[Warmup] = deque()  # sorted by (first, depth): parents before children
        self._items = 0  # items read so far
        self._planned = 0  # positions planned so far
        self._next = 0  # the next position to admit

    @property
    def input_exhausted(self) -> bool:
        """Every item has been read."""
        return self._input is None

    @property
    def done(self) -> bool:
        """Every item has been read and every sequence admitted."""
        return self._input is None and not self._queue

    def read_ahead(self) -> None:
        """Plan the pages the next window needs now (they are planned on demand otherwise)."""
        self._plan_until(self._next + self.window)

    def next_window(self, free: int) -> Window:
        """Up to `free` sequences to admit next, and the warm-ups that the next `window` positions need first."""
        ahead = self._next + self.window
        self._plan_until(ahead)
        admissions = [self._queue.popleft() for _ in range(min(max(0, free), len(self._queue)))]
        if not admissions:
            return Window([], [])
        warmups = []
        while self._warmups and self._warmups[0].node.first < ahead:
            warmups.append(self._warmups.popleft())
        self._next += len(admissions)
        return Window(warmups, admissions)

    def not_started(self) -> dict[int, WorkItem]:
        """Items read but with no choice admitted yet, by item index."""
        return {a.item: a.work for a in self._queue if a.choice == 0}

    def _plan_until(self, position: int) -> None:
        while self._planned < position and self._input is not None:
            page = list(itertools.islice(self._input, self.page_size))
            if self.page_size is None or len(page) < self.page_size:
                self._input = None
            if page:
                self._plan_page(page)

    def _plan_page(self, page: list[WorkItem]) -> None:
        base, first_item = self._planned, self._items
        seqs = [(first_item + i, c, w) for i, w in enumerate(page) for c in range(w.params.n)]
        keys = [w.prompt.key for _, _, w in seqs]
        plan = planner.plan(keys, self.min_shared_tokens if self.reuse else NO_WARMUPS, self.min_shared_tokens)
        order = plan.order if self.reuse else range(len(seqs))  # without reuse, input order (as batch_generate)
        for pos, s in enumerate(order, start=base):
            item, choice, work = seqs[s]
            self._queue.append(Admission(pos, item, choice, work))
        for w in plan.warmups if self.reuse else ():  # (identical prompts make warm-ups even at NO_WARMUPS)
            node = planner.WarmUp(depth=w.depth, first=base + w.first, last=base + w.last)
            self._warmups.append(Warmup(node, seqs[plan.order[w.first]][2].prompt))
        self._items += len(page)
        self._planned += len(seqs)
        if self.on_page is not None:
            self.on_page(PlanTotals(prompt_tokens=plan.prompt_tokens, trie_min_tokens=plan.trie_min_tokens))
