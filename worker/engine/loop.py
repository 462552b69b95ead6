"""The engine: continuous batching with planned prefix reuse, read as schedule -> step -> collect.

An Engine holds the model's backend and its prefix cache across runs. A run takes work items and loops until
they are done or control says stop:
  schedule  the scheduler names the next window (scheduler.py): its shared prefixes are warmed up first
            (warmup.py), then each sequence is admitted as a row that starts from its cached prefix, or, when
            its whole prompt is cached with logits, from those logits
  step      the backend runs one step of the batch (backend/, the only code that drives mlx-lm)
  collect   each row's new tokens go to its sequence (sequence.py, stopping.py); an item whose choices have all
            finished is handed to on_results at once, then forgotten
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from omlx_jobs.errors import ErrorCode, FinishReason
from omlx_jobs.jobs.formats import SamplingParams
from omlx_jobs.jobs.params import OutputParams
from omlx_jobs.worker.backend.model import ModelBackend
from omlx_jobs.worker.backend.rows import Batch, RowOutput, RowSpec
from omlx_jobs.worker.cache.disk import DiskCache
from omlx_jobs.worker.cache.prefix_cache import PrefixCache
from omlx_jobs.worker.engine import faults
from omlx_jobs.worker.engine.config import EngineConfig
from omlx_jobs.worker.engine.contract import Control, Hooks, ResultsHook
from omlx_jobs.worker.engine.limits import check_context, max_new_tokens
from omlx_jobs.worker.engine.results import Choice, PlanTotals, RequestFailure, RunStats, TokenCounters
from omlx_jobs.worker.engine.scheduler import Admission, Scheduler, Window
from omlx_jobs.worker.engine.sequence import Collector, SequenceState, WorkItem
from omlx_jobs.worker.engine.stopping import StopStrings, final_text
from omlx_jobs.worker.engine.warmup import WarmUps
from omlx_jobs.worker.extras.outputs import Outputs, engine_eos
from omlx_jobs.worker.extras.sampling import SamplerFactory
from omlx_jobs.worker.models.loaded import LoadedModel

log = logging.getLogger(__name__)


@dataclass
class _Run:
    """One run's state, passed to each stage instead of a dozen locals."""

    scheduler: Scheduler
    batch: Batch
    hooks: Hooks
    stats: RunStats
    collector: Collector = field(default_factory=Collector)
    active: dict[int, SequenceState] = field(default_factory=dict)
    """Rows in the batch, by row id."""


@dataclass
class _FromLogits:
    """A sequence whose whole prompt is cached with its final logits: it starts from them, not from a prompt."""

    seq: SequenceState
    row: RowSpec


class Engine:
    """Holds the loaded model, its backend and its prefix cache across jobs."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None) -> None:
        self.loaded = loaded
        self.config = cfg = config or EngineConfig()
        self.model, self.tokenizer = loaded.model, loaded.tokenizer
        self.eos = [] if cfg.ignore_eos else engine_eos(loaded)
        self.backend: ModelBackend = loaded.backend(
            eos=self.eos,
            batch_size=cfg.completion_batch_size,
            prefill_batch_size=cfg.prefill_batch_size,
            prefill_step=cfg.prefill_step_size,
            prefill_tokens=cfg.prefill_tokens,
            refill_rows=cfg.refill_rows,
            switches=cfg.switches,
        )
        self.cache = PrefixCache(
            max_bytes=cfg.cache_memory, trimmable=self.backend.trimmable, bucket_tokens=cfg.min_shared_tokens
        )
        self.disk = (
            DiskCache(cfg.cache_dir, loaded.identity, max_bytes=cfg.cache_dir_bytes)
            if cfg.cache_dir and cfg.prefix_cache and self.backend.reusable
            else None
        )
        self.outputs = Outputs(loaded, self.cache, self.backend.prefill_routing)
        self.backend.step_logits = self.outputs.step_logits  # grammar masks and biases: one call per step
        self.warmups = WarmUps(
            self.backend, self.cache, self.disk, batch_size=cfg.prefill_batch_size, min_tokens=cfg.min_shared_tokens
        )
        self.samplers, self.live = SamplerFactory(), TokenCounters()  # live: read by status and heartbeats
        self.window = cfg.completion_batch_size + cfg.prefill_batch_size
        """Rows in flight at most: the decode batch plus one prefill batch."""

    @property
    def prefix_enabled(self) -> bool:
        return self.config.prefix_cache and self.backend.reusable

    @property
    def trimmable(self) -> bool:
        return self.backend.trimmable

    @property
    def ragged(self) -> bool:
        return self.backend.ragged

    # ---- checks ------------------------------------------------------------------------------------

    def check(self, tokens: Sequence[int], params: SamplingParams, output: OutputParams | None = None) -> None:
        """Raise PromptError if the prompt leaves no room to generate within the model's context, or if what it
        asks for beyond sampling cannot run on this model (extras/outputs.py)."""
        if output is not None:
            self.outputs.check(output)
        check_context(tokens, self.loaded.context_length)

    def reset(self) -> None:
        """Drop what an exception mid-run may have left broken: the shared samplers and the in-memory prefix cache
        (entries may hold arrays of the failed graph). The disk tier holds evaluated files and stays."""
        self.samplers = SamplerFactory()
        self.cache.clear()

    # ---- a run ---------------------------------------------------------------------------------------

    def run(self, items: Iterable[WorkItem], hooks: Hooks | ResultsHook, *, page_size: int | None = None) -> RunStats:
        """Generate every item (n choices each); after each step, hooks.results gets the items that finished in it.

        `items` is read `page_size` items at a time (None: all at once), each page planned as it is read, so a
        lazy iterable keeps memory bounded. hooks.admit gets the keys of items about to start (once per refill),
        hooks.plan the totals of each planned page; hooks.control is asked between steps.
        """
        started, before = time.perf_counter(), self.cache.stats.snapshot()
        stats, hooks = RunStats(), Hooks.of(hooks)

        def on_page(totals: PlanTotals) -> None:
            stats.prompt_tokens += totals.prompt_tokens
            stats.trie_min_tokens += totals.trie_min_tokens
            if hooks.plan is not None:
                hooks.plan(totals)

        scheduler = Scheduler(
            items,
            window=self.window,
            reuse=self.prefix_enabled,
            min_shared_tokens=self.config.min_shared_tokens,
            page_size=page_size,
            on_page=on_page,
        )
        scheduler.read_ahead()  # plan before the first admission, as the totals are reported then
        self.warmups.start_run()
        self.cache.start_run()
        batch = self.backend.open(self.cache if self.prefix_enabled else None)
        run = _Run(scheduler, batch, hooks, stats)
        try:
            self._loop(run)
        except BaseException:
            self._close(run, failed=True)
            raise
        self._close(run, failed=False)
        return self._totals(run, started, before)

    def _loop(self, run: _Run) -> None:
        """Schedule -> step -> collect, until the work is done or control says stop."""
        while True:
            self.live.observe(run.stats, self.warmups.stats.tokens, len(run.collector))
            mode = run.hooks.control()
            if mode in (Control.STOP, Control.CANCEL):
                return
            if mode is Control.RUN:
                self._schedule(run)
            if not run.active:
                if mode is not Control.RUN or run.scheduler.done:
                    return
                continue
            self._collect(run, run.batch.step())

    # ---- schedule ------------------------------------------------------------------------------------

    def _schedule(self, run: _Run) -> None:
        """Fill the free rows: warm up the prefixes the next window shares, then admit its sequences."""
        window = run.scheduler.next_window(free=self.window - len(run.active))
        if not window.admissions:
            return
        if run.hooks.admit is not None:
            new = [a.work.key for a in window.admissions if a.item not in run.collector]
            if new:
                run.hooks.admit(list(dict.fromkeys(new)))
        self._warm_up(window)
        self.backend.before_admit(window.admissions, self.cache, keep=self.prefix_enabled)
        from_logits = [p for a in window.admissions if (p := self._admit(run, a)) is not None]
        self._start_from_logits(run, from_logits)
        self._commit(run)

    def _warm_up(self, window: Window) -> None:
        """The window's warm-ups, then its echo prompts' scores in batched passes (extras/echo.py); warm-ups keep
        their prefixes' scores when its requests want prompt logprobs."""
        echo = self.outputs.echo
        prompts = [a.work.prompt for a in window.admissions if a.work.output.echo and a.work.output.logprobs]
        self.warmups.scorer = echo if prompts and echo.usable else None
        self.warmups.ensure(window.warmups)
        if self.warmups.scorer is not None:
            echo.prepare(prompts)

    def _admit(self, run: _Run, a: Admission) -> _FromLogits | None:
        """Insert one sequence as a row from its longest cached prefix; if its whole prompt is cached with logits,
        return it to start from them (all of a refill together, see _start_from_logits)."""
        self.cache.advance(a.position)  # groups that ended before this position release their prefixes
        work, prompt = a.work, a.work.prompt
        n = len(prompt)
        seq = SequenceState(a.item, a.choice, self._stops(work.params))
        row = RowSpec(
            prompt=[],
            max_tokens=max_new_tokens(n, work.params, self.loaded.context_length),
            sampler=self.samplers.sampler(work.params, a.choice),
            processors=self.samplers.logits_processors(work.params),
        )
        if faults.on_row is not None:  # a test hook (worker/engine/faults.py)
            faults.on_row(work, row)
        if self._extras(run, a, seq, row):
            return None
        if work.chat is not None:  # the thinking budget, an answer grammar gated on the thinking (issue 24)
            seq.chat = work.chat
            constraint = seq.extra.logits.constraint if seq.extra is not None else None
            row.processors = work.chat.attach(row.processors, constraint, self.eos)
        match = self.cache.lookup(prompt.key, limit=n) if self.prefix_enabled else None
        if match is not None and match.length == n and match.entry.tokens == n and match.entry.logits is not None:
            run.collector.start(a.item, work, cached=self.warmups.charges.cached(prompt.key, n))
            run.stats.first_token_reuses += 1
            row.prefix, row.context, row.logits = match, prompt.tokens, match.entry.logits
            return _FromLogits(seq, row)
        if match is not None and match.length >= n:  # the last prompt token must run to give logits
            match = self.cache.lookup(prompt.key, limit=n - 1, count=False)
        own = 0  # images: computed from embeddings into a prefix the row starts from (worker/vision/backend.py)
        if prompt.media:
            match, own = self.backend.media_prefix(self.cache, prompt, match, a.position, keep=self.prefix_enabled)
        cached = match.length if match is not None else 0
        run.collector.start(a.item, work, cached=self.warmups.charges.cached(prompt.key, cached - own))
        run.stats.prefill_tokens += n - cached + own
        row.prompt, row.prefix, row.context = prompt.tokens[cached:], match, prompt.tokens[:cached]
        self._insert(run, seq, row)
        return None

    def _extras(self, run: _Run, a: Admission, seq: SequenceState, row: RowSpec) -> bool:
        """Attach what the request asks for beyond sampling (worker/extras/outputs.py); True if it is done already
        (echo with max_tokens 0 scores the prompt only)."""
        before = self.outputs.scored_tokens
        seq.extra = self.outputs.choice(a.work.output, a.work.prompt, row.processors)
        if seq.extra is None:
            return False
        row.processors = seq.extra.processors
        scored = self.outputs.scored_tokens - before
        run.stats.prefill_tokens += scored
        if a.work.params.max_tokens > 0:
            return False
        cached = self.warmups.charges.cached(a.work.prompt.key, len(a.work.prompt) - scored)
        run.collector.start(a.item, a.work, cached=cached)
        self._finish(run, seq, FinishReason.LENGTH)
        return True

    def _start_from_logits(self, run: _Run, pending: list[_FromLogits]) -> None:
        """Sample the first tokens of fully cached sequences (one device wait), then finish or insert each."""
        if not pending:
            return
        outputs = run.batch.first_tokens([p.row for p in pending])
        self.outputs.collect([(p.seq, o) for p, o in zip(pending, outputs, strict=True)])
        for p, out in zip(pending, outputs, strict=True):
            run.stats.generation_tokens += len(out.tokens)
            reason = p.seq.consume(out.tokens, out.finish)
            if reason is not None:
                self._finish(run, p.seq, reason)
                continue
            p.row.prompt, p.row.max_tokens, p.row.logits = out.tokens, p.row.max_tokens - 1, None
            self._insert(run, p.seq, p.row)

    def _insert(self, run: _Run, seq: SequenceState, row: RowSpec) -> None:
        (row_id,) = run.batch.insert([row])
        run.active[row_id] = seq

    def _stops(self, params: SamplingParams) -> StopStrings | None:
        return StopStrings(params.stop, self.tokenizer.detokenizer) if params.stop else None

    # ---- collect -------------------------------------------------------------------------------------

    def _collect(self, run: _Run, outputs: list[RowOutput]) -> None:
        """Hand each row's tokens to its sequence; finish the sequences that ended, and commit their items."""
        active, stopped, generated = run.active, [], 0
        self.outputs.collect([(active.get(o.row), o) for o in outputs])
        for out in outputs:
            seq = active.get(out.row)
            if seq is None:
                continue
            before = seq.generated
            reason = seq.consume(out.tokens, out.finish)
            generated += seq.generated - before  # a stop string inside a step's tokens drops the rest
            if reason is None:
                continue
            if out.finish is None:
                stopped.append(out.row)  # a stop string ended it; the backend would go on
            del active[out.row]
            self._finish(run, seq, reason)
        if stopped:
            run.batch.remove(stopped)
        run.stats.generation_tokens += generated
        self._commit(run)  # together: everything that finished in this step

    def _finish(self, run: _Run, seq: SequenceState, reason: str) -> None:
        text = self.tokenizer.decode(seq.tokens)
        if seq.stops is not None:
            text, reason = final_text(text, seq.stops.stops, reason)
        choice = Choice(text, reason, seq.generated, seq.tokens)
        if seq.extra is not None:
            before, choice.logprobs, choice.prompt_logprobs, error = seq.extra.finish(len(seq.tokens), self.outputs)
            if error is not None:
                message = f"the output broke its response_format grammar: {error}"
                self._fail(run, seq.item, RequestFailure(ErrorCode.GRAMMAR_ERROR, message))
                return
            choice.text = before + text
        if seq.chat is not None:  # the thinking split from the answer, tool calls parsed
            choice.text, choice.finish_reason, choice.chat = seq.chat.finish(choice.text, seq.tokens, reason)
        run.collector.finish(seq.item, seq.choice, choice)

    def _fail(self, run: _Run, item: int, failure: RequestFailure) -> None:
        """One item fails alone: its other rows leave the batch first."""
        rows = [r for r, s in run.active.items() if s.item == item]
        if rows:
            run.batch.remove(rows)
            for r in rows:
                del run.active[r]
        if item in run.collector:
            run.collector.fail(item, failure)

    def _commit(self, run: _Run) -> None:
        results = run.collector.take()
        if results:
            run.hooks.results(results)

    # ---- end of a run --------------------------------------------------------------------------------

    def _close(self, run: _Run, *, failed: bool) -> None:
        """Close the batch and release every cache hold. Each step runs even if another fails; after a failed run
        their errors are only logged, so that the run's own error is the one raised."""
        errors = []
        for step in (run.batch.close, self.cache.end_run):
            try:
                step()
            except Exception as exc:
                log.exception("clean-up after a run failed")
                errors.append(exc)
        if errors and not failed:
            raise errors[0]

    def _totals(self, run: _Run, started: float, before: dict[str, int]) -> RunStats:
        stats, warm, after = run.stats, self.warmups.stats, self.cache.stats.snapshot()
        stats.prefill_seconds = run.batch.timings.prefill_seconds
        stats.decode_seconds = run.batch.timings.decode_seconds
        stats.warmups, stats.warmup_tokens, stats.warmup_seconds = warm.warmups, warm.tokens, warm.seconds
        stats.disk_hits = warm.disk_hits
        stats.prefill_tokens += warm.tokens
        stats.cache_hits = after["hits"] - before["hits"]
        stats.cache_misses = after["misses"] - before["misses"]
        stats.cache_evictions = after["evictions"] - before["evictions"]
        spec = getattr(run.batch, "speculation", None)  # decode batches that can speculate (backend/speculative.py)
        if spec is not None:
            stats.drafted_tokens, stats.accepted_tokens, stats.verify_steps = (
                spec.drafted,
                spec.accepted,
                spec.verify_steps,
            )
        left = {**run.collector.unfinished(), **run.scheduler.not_started()}
        stats.unfinished = [left[i].key for i in sorted(left)]
        stats.input_exhausted = run.scheduler.input_exhausted
        stats.peak_live_items = run.collector.peak
        stats.seconds = time.perf_counter() - started
        return stats
