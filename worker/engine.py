"""Engine adapter: continuous batching over mlx-lm's BatchGenerator, with planned prefix reuse.

With kv.py, warmup.py and attention.py, the only code that touches mlx-lm internals (BatchGenerator, KV cache
classes, the attention call of a few model modules).
run(): plan the shard (planner), then admit sequences depth-first, prefilling each shared prefix once
(a warm-up) and inserting requests with copies of the cached prefix; refill the batch as requests finish.
"""

from __future__ import annotations

import contextlib
import enum
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache

from omlx_jobs.jobs.formats import SamplingParams
from omlx_jobs.worker import attention, kv, planner
from omlx_jobs.worker.disk_cache import DiskCache
from omlx_jobs.worker.model import LoadedModel, PromptError
from omlx_jobs.worker.prefix_cache import DEFAULT_CACHE_MEMORY, Entry, PrefixCache
from omlx_jobs.worker.sampling import SamplerFactory
from omlx_jobs.worker.warmup import WarmUps, WarmupStats


class Control(enum.Enum):
    RUN = "run"
    DRAIN = "drain"  # admit nothing new; let in-flight requests finish
    STOP = "stop"  # stop now; unfinished requests stay pending (they run again later)
    CANCEL = "cancel"  # stop now; unfinished requests are reported for cancellation


@dataclass
class EngineConfig:
    completion_batch_size: int = 32
    prefill_batch_size: int = 8
    prefill_step_size: int = 2048
    prefix_cache: bool = True
    min_shared_tokens: int = planner.DEFAULT_MIN_SHARED_TOKENS
    cache_memory: int | None = DEFAULT_CACHE_MEMORY
    cache_dir: str | None = None
    cache_dir_bytes: int = 10 * 1024**3
    ignore_eos: bool = False
    """Generate max_tokens every time (for benchmarks)."""
    ragged_decode: bool = True
    """On CUDA, decode attention without mlx-lm's padding mask (worker/attention.py); no effect elsewhere."""

    def __post_init__(self) -> None:
        if self.completion_batch_size < 1 or self.prefill_batch_size < 1 or self.prefill_step_size < 1:
            raise ValueError("batch sizes and the prefill step must be at least 1")
        if self.min_shared_tokens < 1:
            raise ValueError("min_shared_tokens must be at least 1")


@dataclass
class WorkItem:
    key: Any
    tokens: list[int]
    params: SamplingParams


@dataclass
class Choice:
    text: str
    finish_reason: str
    completion_tokens: int
    token_ids: list[int]


@dataclass
class ItemResult:
    key: Any
    choices: list[Choice]
    prompt_tokens: int
    cached_tokens: int
    started_at: float
    finished_at: float

    @property
    def completion_tokens(self) -> int:
        return sum(c.completion_tokens for c in self.choices)


@dataclass
class RunStats:
    prompt_tokens: int = 0
    trie_min_tokens: int = 0
    prefill_tokens: int = 0
    """Prompt tokens actually run through the model: warm-ups plus every uncached suffix."""
    warmup_tokens: int = 0
    warmups: int = 0
    warmup_seconds: float = 0.0
    first_token_reuses: int = 0
    disk_hits: int = 0
    generation_tokens: int = 0
    prefill_seconds: float = 0.0
    """Time in BatchGenerator's prompt processing (uncached suffixes, including merging cached prefixes)."""
    decode_seconds: float = 0.0
    seconds: float = 0.0
    unfinished: list[Any] = field(default_factory=list)
    cache_hits: int = 0
    cache_misses: int = 0
    cache_evictions: int = 0
    """Prefix-cache lookups and evictions during this run (the cache itself lives across runs)."""


@dataclass
class _Seq:
    item: int
    choice: int
    stops: tuple[str, ...]
    tokens: list[int] = field(default_factory=list)
    generated: int = 0
    detok: Any = None
    scanned: int = 0


@dataclass
class _FirstToken:
    """A sequence whose whole prompt is cached: its first token, sampled from the cached logits (lazily)."""

    seq: _Seq
    token: mx.array
    caches: list[Any]
    sampler: Any
    processors: list[Any]
    max_tokens: int


@dataclass
class _ItemState:
    remaining: int
    started_at: float
    cached: int
    choices: dict[int, Choice] = field(default_factory=dict)


class Engine:
    """Holds the loaded model and its prefix cache across jobs."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None) -> None:
        self.loaded = loaded
        self.config = config or EngineConfig()
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        probe = make_prompt_cache(self.model)
        self.trimmable = can_trim_prompt_cache(probe)
        # Reuse needs caches BatchGenerator can merge; others fall back to no reuse.
        self.reusable = all(hasattr(c, "merge") for c in probe)
        self.cache = PrefixCache(
            max_bytes=self.config.cache_memory,
            trimmable=self.trimmable,
            bucket_tokens=self.config.min_shared_tokens,
        )
        self.disk = (
            DiskCache(self.config.cache_dir, loaded.identity, max_bytes=self.config.cache_dir_bytes)
            if self.config.cache_dir and self.config.prefix_cache and self.reusable
            else None
        )
        self.warmups = WarmUps(
            self.model,
            self.cache,
            self.disk,
            trimmable=self.trimmable,
            batch_size=self.config.prefill_batch_size,
            step=self.config.prefill_step_size,
            min_tokens=self.config.min_shared_tokens,
        )
        self.samplers = SamplerFactory()
        self._last_view: tuple[Entry, int, list[Any]] | None = None
        self.eos = [] if self.config.ignore_eos else sorted(self.tokenizer.eos_token_ids)
        self.ragged = self.config.ragged_decode and attention.available() and attention.install(self.model)

    @property
    def prefix_enabled(self) -> bool:
        return self.config.prefix_cache and self.reusable

    # ---- checks ------------------------------------------------------------------------------------

    def check(self, tokens: Sequence[int], params: SamplingParams) -> None:
        """Raise PromptError if the prompt leaves no room to generate within the model's context."""
        ctx = self.loaded.context_length
        if len(tokens) >= ctx:
            raise PromptError(
                "context_length_exceeded",
                f"the prompt is {len(tokens)} tokens; this model's context is {ctx} tokens. Shorten the prompt",
            )

    def max_new_tokens(self, n_prompt: int, params: SamplingParams) -> int:
        return max(1, min(params.max_tokens, self.loaded.context_length - n_prompt))

    # ---- the run loop --------------------------------------------------------------------------

    def run(
        self,
        items: Sequence[WorkItem],
        on_results: Callable[[list[ItemResult]], None],
        control: Callable[[], Control] = lambda: Control.RUN,
        *,
        on_admit: Callable[[list[Any]], None] | None = None,
        on_plan: Callable[[RunStats], None] | None = None,
    ) -> RunStats:
        """Generate every item (n choices each); after each step, on_results gets the items that finished in it.

        on_admit gets the keys of items about to start (once per refill); on_plan the planned totals.
        """
        with attention.enabled() if self.ragged else contextlib.nullcontext():
            return self._run(items, on_results, control, on_admit, on_plan)

    def _run(
        self,
        items: Sequence[WorkItem],
        on_results: Callable[[list[ItemResult]], None],
        control: Callable[[], Control],
        on_admit: Callable[[list[Any]], None] | None,
        on_plan: Callable[[RunStats], None] | None,
    ) -> RunStats:
        started = time.perf_counter()
        self.warmups.stats = WarmupStats()
        stats = RunStats()
        before = self.cache.stats.snapshot()
        seqs = [(i, c) for i, item in enumerate(items) for c in range(item.params.n)]
        item_keys = [planner.token_key(item.tokens) for item in items]
        keys = [item_keys[i] for i, _ in seqs]
        if self.prefix_enabled:
            the_plan = planner.plan(keys, self.config.min_shared_tokens)
        else:  # input order, no warm-ups: what mlx_lm.batch_generate does
            minimum = planner.plan(keys, 1 << 30)
            the_plan = planner.Plan(list(range(len(seqs))), [], minimum.trie_min_tokens, minimum.prompt_tokens)
        stats.trie_min_tokens = the_plan.trie_min_tokens
        stats.prompt_tokens = the_plan.prompt_tokens
        if on_plan is not None:
            on_plan(stats)
        warmups, next_w = the_plan.warmups, 0
        for entry in self.cache.entries():
            entry.needed_until = -1  # left from an earlier run: its subtree here is unknown, evict first

        gen = BatchGenerator(
            self.model,
            stop_tokens=[[t] for t in self.eos],
            completion_batch_size=self.config.completion_batch_size,
            prefill_batch_size=self.config.prefill_batch_size,
            prefill_step_size=self.config.prefill_step_size,
        )
        # mlx-lm copies each finished sequence's KV cache out to return it; nothing here uses it.
        gen._generation_batch.extract_cache = lambda idx: None
        window = self.config.completion_batch_size + self.config.prefill_batch_size
        states: dict[int, _ItemState] = {}
        active: dict[int, _Seq] = {}
        pinned: list[tuple[Entry, int]] = []
        done: list[ItemResult] = []
        pos = 0
        try:
            while True:
                mode = control()
                if mode in (Control.STOP, Control.CANCEL):
                    break
                batch = the_plan.order[pos : pos + max(0, window - len(active))] if mode is Control.RUN else []
                if batch and on_admit is not None:
                    new = [items[seqs[s][0]].key for s in batch if seqs[s][0] not in states]
                    if new:
                        on_admit(list(dict.fromkeys(new)))
                if batch:
                    # Warm up every shared prefix the next window needs, batched, before admitting into it.
                    ahead = pos + window
                    upcoming = []
                    while next_w < len(warmups) and warmups[next_w].first < ahead:
                        upcoming.append(warmups[next_w])
                        next_w += 1
                    if upcoming:
                        pinned += self.warmups.ensure(
                            [(w, keys[the_plan.order[w.first]][: w.depth * 4]) for w in upcoming], gen.stream
                        )
                first_tokens = []
                for s in batch:
                    self.cache.advance(pos)
                    pinned = self._release_pins(pinned, pos)
                    i, c = seqs[s]
                    first = self._admit(gen, items, i, c, item_keys[i], states, active, stats)
                    if first is not None:
                        first_tokens.append(first)
                    pos += 1
                self._admit_first_tokens(gen, first_tokens, items, states, active, stats, done)
                if done:
                    on_results(done)
                    done = []
                if not active:
                    if mode is not Control.RUN or pos >= len(the_plan.order):
                        break
                    continue
                _, responses = gen.next()  # one step; a long prefill still returns here to check control
                for r in responses:
                    seq = active.get(r.uid)
                    if seq is None:
                        continue
                    seq.generated += 1
                    stats.generation_tokens += 1
                    reason = r.finish_reason
                    if reason != "stop":
                        seq.tokens.append(r.token)
                        if seq.stops and self._hit_stop(seq):
                            gen.remove([r.uid])
                            reason = "stop"
                    if reason is not None:
                        del active[r.uid]
                        self._finish(seq, reason, items, states, done)
                if done:
                    on_results(done)  # committed together: everything that finished in this step
                    done = []
        finally:
            if active:
                gen.remove(list(active))
            stats.prefill_seconds = gen._counters.prompt_time
            stats.decode_seconds = gen._counters.decode_time
            gen.close()
            for entry, _ in pinned:
                self.cache.unpin(entry)
            self.cache.evict_to_fit()
        warm = self.warmups.stats
        stats.warmups, stats.warmup_tokens, stats.warmup_seconds = warm.warmups, warm.tokens, warm.seconds
        stats.disk_hits = warm.disk_hits
        after = self.cache.stats.snapshot()
        stats.cache_hits = after["hits"] - before["hits"]
        stats.cache_misses = after["misses"] - before["misses"]
        stats.cache_evictions = after["evictions"] - before["evictions"]
        stats.prefill_tokens += warm.tokens
        stats.unfinished = [items[i].key for i in range(len(items)) if i not in states or states[i].remaining]
        stats.seconds = time.perf_counter() - started
        return stats

    def _release_pins(self, pinned: list[tuple[Entry, int]], pos: int) -> list[tuple[Entry, int]]:
        keep = []
        for entry, last in pinned:
            if last < pos:
                self.cache.unpin(entry)
            else:
                keep.append((entry, last))
        if len(keep) != len(pinned):
            self.cache.evict_to_fit()
        return keep

    # ---- admission -------------------------------------------------------------------------------

    def _admit(
        self,
        gen: BatchGenerator,
        items: Sequence[WorkItem],
        i: int,
        choice: int,
        key: bytes,
        states: dict[int, _ItemState],
        active: dict[int, _Seq],
        stats: RunStats,
    ) -> _FirstToken | None:
        """Insert one sequence; if its whole prompt is cached with logits, return its lazily sampled first token.

        Those are finished by _admit_first_tokens, all of a refill at once: reading a token back waits for the
        device, and one wait per request (while a decode step is in flight) cost more than it saved on a GPU.
        """
        item = items[i]
        tokens, params = item.tokens, item.params
        n = len(tokens)
        sampler = self.samplers.sampler(params, choice)
        processors = self.samplers.logits_processors(params)
        max_tokens = self.max_new_tokens(n, params)
        seq = _Seq(item=i, choice=choice, stops=params.stop)
        if seq.stops:
            seq.detok = self.tokenizer.detokenizer
            seq.detok.reset()

        match = self.cache.lookup(key, limit=n) if self.prefix_enabled else None
        if match is not None and match.length == n and match.entry.tokens == n and match.entry.logits is not None:
            # The whole prompt is cached with its final logits: sample the first token from them.
            self._note_start(states, i, item, cached=n)
            stats.first_token_reuses += 1
            first = self._sample_first(match.entry.logits, tokens, sampler, processors)
            return _FirstToken(seq, first, self._view(match.entry, n), sampler, processors, max_tokens)
        if match is not None and match.length >= n:
            match = self.cache.lookup(key, limit=n - 1, count=False)
        cached = match.length if match is not None else 0
        self._note_start(states, i, item, cached=cached)
        stats.prefill_tokens += n - cached
        caches = self._view(match.entry, cached) if match is not None else None
        self._insert(gen, active, seq, tokens[cached:], caches, list(tokens[:cached]), sampler, processors, max_tokens)
        return None

    def _admit_first_tokens(
        self,
        gen: BatchGenerator,
        pending: list[_FirstToken],
        items: Sequence[WorkItem],
        states: dict[int, _ItemState],
        active: dict[int, _Seq],
        stats: RunStats,
        done: list[ItemResult],
    ) -> None:
        """Read the first tokens of a refill's fully cached sequences back at once, then finish or insert them."""
        if not pending:
            return
        mx.eval([p.token for p in pending])
        for p in pending:
            seq, first = p.seq, int(p.token.item())
            seq.generated = 1
            stats.generation_tokens += 1
            if first in self.eos:
                self._finish(seq, "stop", items, states, done)
                continue
            seq.tokens.append(first)
            if p.max_tokens == 1 or (seq.stops and self._hit_stop(seq)):
                self._finish(seq, "length" if p.max_tokens == 1 else "stop", items, states, done)
                continue
            tokens = items[seq.item].tokens
            self._insert(gen, active, seq, [first], p.caches, list(tokens), p.sampler, p.processors, p.max_tokens - 1)

    @staticmethod
    def _insert(
        gen: BatchGenerator,
        active: dict[int, _Seq],
        seq: _Seq,
        prompt: list[int],
        caches: list[Any] | None,
        all_tokens: list[int],
        sampler: Any,
        processors: list[Any],
        max_tokens: int,
    ) -> None:
        (uid,) = gen.insert(
            [prompt],
            max_tokens=[max_tokens],
            caches=[caches],
            all_tokens=[all_tokens],
            samplers=[sampler],
            logits_processors=[processors],
        )
        active[uid] = seq

    def _view(self, entry: Entry, length: int) -> list[Any]:
        """kv.view, reused across the consecutive admissions of a group (they share one prefix view)."""
        if self._last_view is None or self._last_view[0] is not entry or self._last_view[1] != length:
            self._last_view = (entry, length, kv.view(entry.value, entry.tokens, length))
        return self._last_view[2]

    def _note_start(self, states: dict[int, _ItemState], i: int, item: WorkItem, cached: int) -> None:
        state = states.get(i)
        if state is None:
            states[i] = _ItemState(remaining=item.params.n, started_at=time.time(), cached=cached)
        else:
            state.cached = min(state.cached, cached)

    def _sample_first(self, logits: mx.array, tokens: list[int], sampler: Any, processors: list[Any]) -> mx.array:
        if processors:
            context = mx.array(tokens)
            for proc in processors:
                logits = proc(context, logits)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return sampler(logprobs) if sampler is not None else mx.argmax(logprobs, axis=-1)

    # ---- finishing ---------------------------------------------------------------------------------

    def _hit_stop(self, seq: _Seq) -> bool:
        """Feed the newest token to the sequence's detokenizer; True once a stop string appears."""
        seq.detok.add_token(seq.tokens[-1])
        text = seq.detok.text
        longest = max(len(s) for s in seq.stops)
        start = max(0, seq.scanned - longest + 1)
        seq.scanned = len(text)
        return any(s in text[start:] for s in seq.stops)

    def _finish(
        self,
        seq: _Seq,
        reason: str,
        items: Sequence[WorkItem],
        states: dict[int, _ItemState],
        done: list[ItemResult],
    ) -> None:
        text = self.tokenizer.decode(seq.tokens)
        if seq.stops:
            cut = min((p for p in (text.find(s) for s in seq.stops) if p >= 0), default=-1)
            if cut >= 0:
                text, reason = text[:cut], "stop"
        state = states[seq.item]
        state.choices[seq.choice] = Choice(text, reason, seq.generated, list(seq.tokens))
        state.remaining -= 1
        if state.remaining == 0:
            item = items[seq.item]
            done.append(
                ItemResult(
                    key=item.key,
                    choices=[state.choices[c] for c in range(item.params.n)],
                    prompt_tokens=len(item.tokens),
                    cached_tokens=state.cached,
                    started_at=state.started_at,
                    finished_at=time.time(),
                )
            )
