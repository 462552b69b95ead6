"""A running job's figures from its live token counts (store/ticks.py): tokens per second now, per worker and in
all, requests in flight, throughput over time binned by when tokens were computed, and the ETA (from tokens left
to generate, or for a job that generates nothing, embeddings, from prompt tokens left to compute). Pure.

Rows are spans of one worker's tokens; a span's tokens are taken as spread evenly over it, both for a rate
over a window and for the plot's bins.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

RATE_WINDOW_SECONDS = 20.0
"""Current rates are over the last this many seconds of each worker's counts."""
STALE_SECONDS = 15.0
"""A worker whose last count for the job is older than this is not running it now (finished, stopped, dead)."""
MIN_ESTIMATE_SECONDS = 10.0
"""An ETA needs at least this much counted time."""
MIN_FINISHED = 5
"""Below this many completed requests, the expected answer length is the requests' max_tokens."""


class Span(Protocol):
    worker: str
    started_at: float
    ended_at: float
    prompt_tokens: int
    completion_tokens: int
    in_flight: int


@dataclass(frozen=True)
class WorkerRate:
    worker: str
    prompt_tokens_per_second: float
    generated_tokens_per_second: float
    in_flight: int
    as_of: float


@dataclass(frozen=True)
class Current:
    """A job's figures now: the sum over the workers counting for it within STALE_SECONDS."""

    prompt_tokens_per_second: float = 0.0
    generated_tokens_per_second: float = 0.0
    in_flight: int = 0
    workers: list[WorkerRate] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens_per_second": round(self.prompt_tokens_per_second, 2),
            "generated_tokens_per_second": round(self.generated_tokens_per_second, 2),
            "requests_in_flight": self.in_flight,
            "workers": [
                {
                    "worker": w.worker,
                    "prompt_tokens_per_second": round(w.prompt_tokens_per_second, 2),
                    "generated_tokens_per_second": round(w.generated_tokens_per_second, 2),
                    "requests_in_flight": w.in_flight,
                    "as_of": w.as_of,
                }
                for w in self.workers
            ],
        }


def _share(span: Span, lo: float, hi: float) -> float:
    """The part of `span` inside [lo, hi] (all of it for a span of no length inside it)."""
    length = span.ended_at - span.started_at
    if length <= 0:
        return 1.0 if lo <= span.ended_at <= hi else 0.0
    return max(0.0, min(hi, span.ended_at) - max(lo, span.started_at)) / length


def current(spans: Iterable[Span], now: float, window: float = RATE_WINDOW_SECONDS) -> Current:
    """Tokens per second over each live worker's last `window` seconds of counts, and its requests in flight."""
    by_worker: dict[str, list[Span]] = {}
    for s in spans:
        by_worker.setdefault(s.worker, []).append(s)
    rates = []
    for worker, rows in sorted(by_worker.items()):
        last = max(rows, key=lambda s: s.ended_at)
        if now - last.ended_at > STALE_SECONDS:
            continue
        hi = last.ended_at
        lo = max(hi - window, min(s.started_at for s in rows))
        seconds = hi - lo
        if seconds <= 0:
            continue
        prompt = sum(s.prompt_tokens * _share(s, lo, hi) for s in rows)
        generated = sum(s.completion_tokens * _share(s, lo, hi) for s in rows)
        rates.append(WorkerRate(worker, prompt / seconds, generated / seconds, last.in_flight, hi))
    return Current(
        sum(r.prompt_tokens_per_second for r in rates),
        sum(r.generated_tokens_per_second for r in rates),
        sum(r.in_flight for r in rates),
        rates,
    )


@dataclass(frozen=True)
class Bin:
    start: float
    seconds: float
    prompt_tokens: float
    completion_tokens: float

    def to_dict(self) -> dict[str, float]:
        return {
            "t": self.start,
            "seconds": self.seconds,
            "prompt_tps": round(self.prompt_tokens / self.seconds, 2),
            "completion_tps": round(self.completion_tokens / self.seconds, 2),
        }


def bin_width(span: float, max_bins: int) -> float:
    """A round bin width (1, 2, 5, 10, 15, 30 s, 1, 2, 5, 10, 15, 30 min, hours) giving at most max_bins."""
    for width in (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600):
        if span / width <= max_bins:
            return float(width)
    return 3600.0 * math.ceil(span / 3600 / max_bins)


def series(spans: Sequence[Span], max_bins: int = 60, end: float | None = None) -> list[Bin]:
    """Prompt and generated tokens per second over the job's life, in equal bins by when they were computed
    (empty bins included: a stall shows as one). `end`: the plot's right edge (now, for a running job). The
    bin holding the last count is as long as the counted part of it, so an open bin does not read low."""
    if not spans:
        return []
    first = min(s.started_at for s in spans)
    counted = max(s.ended_at for s in spans)
    last = max(end or 0.0, counted)
    width = bin_width(max(last - first, 1.0), max_bins)
    n = min(int((last - first) // width) + 1, max_bins + 1)
    prompt, completion = [0.0] * n, [0.0] * n
    for s in spans:
        lo_bin = min(int((s.started_at - first) // width), n - 1)
        hi_bin = min(int((s.ended_at - first) // width), n - 1)
        for k in range(lo_bin, hi_bin + 1):
            share = _share(s, first + k * width, first + (k + 1) * width)
            prompt[k] += s.prompt_tokens * share
            completion[k] += s.completion_tokens * share
    bins = []
    for k in range(n):
        start = first + k * width
        seconds = min(width, counted - start) if start < counted < start + width else width
        bins.append(Bin(start, max(seconds, min(width, 1.0)), prompt[k], completion[k]))
    return bins


@dataclass(frozen=True)
class Estimate:
    """When a job should end, and from what: `state` is "tokens" (an ETA from tokens left and the current
    rate), "estimating" (not enough counted yet), "stalled" (nothing counted now) or "done"."""

    state: str
    eta_seconds: float | None = None
    remaining_tokens: int | None = None
    expected_completion_tokens: float | None = None
    """Tokens one unfinished request is expected to generate in all."""
    basis: str = "generated"
    """What remaining_tokens counts and the rate divides: "generated" tokens, or for a job whose requests
    generate nothing (embeddings, scoring) "prompt" tokens left to compute at the prompt tokens per second now."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "basis": self.basis,
            "eta_seconds": None if self.eta_seconds is None else round(self.eta_seconds, 1),
            "remaining_tokens": self.remaining_tokens,
            "expected_completion_tokens": (
                None if self.expected_completion_tokens is None else round(self.expected_completion_tokens, 1)
            ),
        }


@dataclass(frozen=True)
class Progress:
    """What the ETA is computed from: the store's counts and the job's live counts."""

    pending: int
    completed: int
    completion_tokens: int
    """Of the completed requests."""
    counted_completion_tokens: int
    """Every token the workers generated for the job (live counts), finished requests' and unfinished ones'."""
    counted_seconds: float
    """Time covered by live counts so far."""
    max_completion_tokens: float | None
    """The mean of max_tokens x n over (a sample of) the job's requests; None when unknown; 0 when they generate
    nothing (embeddings)."""
    prompt_tokens: int = 0
    """Of the completed requests."""
    cached_tokens: int = 0
    """Of the completed requests: their prompt tokens not computed for them (a prefix computed once)."""


def estimate(p: Progress, now: Current, *, terminal: bool = False) -> Estimate:
    """Tokens left = unfinished requests x the expected answer length (the mean so far once MIN_FINISHED
    requests completed, never above max_tokens; max_tokens before that) - what they generated already;
    ETA = tokens left / the generated tokens per second now."""
    if terminal or p.pending == 0:
        return Estimate("done", 0.0 if not terminal else None, 0)
    expected = p.max_completion_tokens
    if p.completed >= MIN_FINISHED:
        mean = p.completion_tokens / p.completed
        expected = min(mean, expected) if expected is not None else mean
    if expected == 0:
        return _prompt_estimate(p, now)
    if expected is None or p.counted_seconds < MIN_ESTIMATE_SECONDS:
        return Estimate("estimating", expected_completion_tokens=expected)
    started = max(0, p.counted_completion_tokens - p.completion_tokens)
    started = min(started, int(now.in_flight * expected))  # tokens of cancelled or re-run requests aside
    remaining = max(0, int(p.pending * expected) - started)
    if now.generated_tokens_per_second <= 0:
        return Estimate("stalled", None, remaining, expected)
    return Estimate("tokens", remaining / now.generated_tokens_per_second, remaining, expected)


def _prompt_estimate(p: Progress, now: Current) -> Estimate:
    """A job that generates nothing: tokens left = unfinished requests x the completed ones' mean prompt tokens x
    the share of them computed (not cached); ETA = that / the prompt tokens per second now (computed ones)."""
    if p.completed < MIN_FINISHED or p.counted_seconds < MIN_ESTIMATE_SECONDS or not p.prompt_tokens:
        return Estimate("estimating", expected_completion_tokens=0.0, basis="prompt")
    computed = 1 - min(p.cached_tokens, p.prompt_tokens) / p.prompt_tokens
    remaining = int(p.pending * p.prompt_tokens / p.completed * computed)
    if now.prompt_tokens_per_second <= 0:
        return Estimate("stalled", None, remaining, 0.0, basis="prompt")
    return Estimate("tokens", remaining / now.prompt_tokens_per_second, remaining, 0.0, basis="prompt")
