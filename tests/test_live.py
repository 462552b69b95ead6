"""Live figures without Redis, SQL or MLX: the engine's counters across runs, the rows a shard writes (bounded),
the current rates, the plot's bins by when tokens were computed, and the ETA from tokens."""

from __future__ import annotations

import itertools

import pytest

from omlx_jobs.jobs.live import ROWS_PER_AGE, RateMeter, TickWriter
from omlx_jobs.jobs.throughput import Current, Progress, current, estimate, series
from omlx_jobs.store.ticks import Tick
from omlx_jobs.worker.engine.results import RunStats, TokenCounters


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class Sink:
    """A store's two tick calls, kept as rows."""

    def __init__(self) -> None:
        self.rows: dict[int, list[object]] = {}

    def add_tick(self, job_id, worker, started_at, ended_at, prompt, completion, in_flight):  # type: ignore[no-untyped-def]
        self.rows[len(self.rows)] = [job_id, worker, started_at, ended_at, prompt, completion, in_flight]
        return len(self.rows) - 1

    def extend_tick(self, tick_id, ended_at, prompt, completion, in_flight):  # type: ignore[no-untyped-def]
        row = self.rows[tick_id]
        row[3], row[6] = ended_at, in_flight
        row[4] += prompt  # type: ignore[operator]
        row[5] += completion  # type: ignore[operator]

    def ticks(self) -> list[Tick]:
        return [Tick(*r) for r in self.rows.values()]  # type: ignore[arg-type]


def test_counters_add_runs_up_with_their_warm_ups() -> None:
    live = TokenCounters()
    first = RunStats()
    live.observe(first, warmup_tokens=0, in_flight=0)
    first.prefill_tokens, first.generation_tokens = 40, 10
    live.observe(first, warmup_tokens=100, in_flight=3)
    assert live.snapshot() == (140, 10, 3)
    second = RunStats()  # a new run starts from zero; its warm-ups are counted anew
    live.observe(second, warmup_tokens=0, in_flight=1)
    assert live.snapshot() == (140, 10, 1)
    second.generation_tokens = 5
    live.observe(second, warmup_tokens=7, in_flight=1)
    assert live.snapshot() == (147, 15, 1)


def test_a_shard_writes_its_counts_every_tick_into_rows_that_grow_with_the_job() -> None:
    clock, sink, live = Clock(), Sink(), TokenCounters()
    stats = RunStats()
    writer = TickWriter(sink, live, "batch_x", "w1", job_created_at=clock.t, clock=clock, every=2.0)
    for _second in range(1, 3601):
        clock.t += 1.0
        stats.generation_tokens += 10
        stats.prefill_tokens += 3
        live.observe(stats, 0, 4)
        writer.maybe_tick()
    writer.close()
    ticks = sink.ticks()
    assert sum(t.completion_tokens for t in ticks) == 36000  # nothing lost between rows
    assert sum(t.prompt_tokens for t in ticks) == 10800
    # An hour at a tick every 2 s: rows span up to 1/ROWS_PER_AGE of the age, so far fewer than 1,800 rows.
    assert len(ticks) < 2 * ROWS_PER_AGE * 3
    assert all(a.ended_at == b.started_at for a, b in itertools.pairwise(ticks))
    assert ticks[-1].in_flight == 0  # the shard ended: nothing of it is in flight
    assert ticks[0].seconds == pytest.approx(2.0)


def test_a_failed_write_carries_its_counts_to_the_next_tick() -> None:
    clock, live = Clock(), TokenCounters()

    class Flaky(Sink):
        fail = True

        def add_tick(self, *args):  # type: ignore[no-untyped-def]
            if self.fail:
                self.fail = False
                raise OSError("database is locked")
            return super().add_tick(*args)

    sink, stats = Flaky(), RunStats()
    writer = TickWriter(sink, live, "batch_x", "w1", job_created_at=clock.t, clock=clock, every=2.0)
    stats.generation_tokens = 50
    live.observe(stats, 0, 1)
    clock.t += 2
    writer.maybe_tick()  # fails, logged
    assert sink.rows == {}
    clock.t += 2
    writer.maybe_tick()
    assert sink.ticks()[0].completion_tokens == 50


def test_the_rate_meter_rates_the_last_window_of_samples() -> None:
    clock, live, stats = Clock(0.0), TokenCounters(), RunStats()
    meter = RateMeter(window=20.0, clock=clock)
    for _ in range(60):
        clock.t += 2.0
        stats.generation_tokens += 100 if clock.t <= 60 else 20  # 50 tok/s for a minute, then 10 tok/s
        stats.prefill_tokens += 10
        live.observe(stats, 0, 8)
        rates = meter.sample(live)
    assert rates.generated_tokens_per_second == pytest.approx(10.0)
    assert rates.prompt_tokens_per_second == pytest.approx(5.0)
    assert rates.in_flight == 8 and rates.generated_tokens == 30 * 100 + 30 * 20
    assert meter.sample(live, busy=False).in_flight == 0
    assert RateMeter().sample(None).generated_tokens_per_second == 0.0


def _tick(worker: str, start: float, end: float, prompt: int = 0, completion: int = 0, in_flight: int = 0) -> Tick:
    return Tick("batch_x", worker, start, end, prompt, completion, in_flight)


def test_current_rates_sum_live_workers_and_leave_out_stale_ones() -> None:
    ticks = [_tick("a", t, t + 2, prompt=20, completion=100, in_flight=5) for t in range(0, 100, 2)]
    ticks += [_tick("b", t, t + 2, completion=40, in_flight=2) for t in range(50, 100, 2)]
    ticks += [_tick("gone", 0, 60, completion=6000, in_flight=9)]  # stopped counting 40 s ago
    now = current(ticks, now=101.0)
    assert now.generated_tokens_per_second == pytest.approx(50 + 20)
    assert now.prompt_tokens_per_second == pytest.approx(10)
    assert now.in_flight == 7
    assert [w.worker for w in now.workers] == ["a", "b"]
    # One long row (an old job's coarse row) still gives its average as the current rate.
    assert current([_tick("a", 0, 600, completion=6000)], now=600).generated_tokens_per_second == pytest.approx(10)
    assert current([], now=5).generated_tokens_per_second == 0


def test_the_plot_bins_tokens_when_they_were_computed_not_when_requests_finished() -> None:
    # 100 tok/s for 100 s, in rows of 2 s, then one coarse row of 50 s at 20 tok/s.
    ticks = [_tick("a", t, t + 2, completion=200) for t in range(0, 100, 2)] + [_tick("a", 100, 150, completion=1000)]
    bins = series(ticks, max_bins=30)
    assert len(bins) <= 31
    width = bins[0].seconds
    assert width == 5.0
    assert sum(b.completion_tokens for b in bins) == pytest.approx(11000)
    rates = [b.completion_tokens / b.seconds for b in bins]
    assert all(r == pytest.approx(100) for r in rates[:20])  # steady: no spikes, no empty bins
    assert all(r == pytest.approx(20) for r in rates[20:30])
    gap = series([_tick("a", 0, 10, completion=100), _tick("a", 50, 60, completion=100)], max_bins=60)
    assert [b.completion_tokens for b in gap if 10 <= b.start < 50] == [0.0] * 40  # a stall shows as one


def _progress(**kw: object) -> Progress:
    base: dict[str, object] = {
        "pending": 500,
        "completed": 500,
        "completion_tokens": 500 * 100,
        "counted_completion_tokens": 500 * 100 + 32 * 50,
        "counted_seconds": 60.0,
        "max_completion_tokens": 256.0,
    }
    base.update(kw)
    return Progress(**base)  # type: ignore[arg-type]


def test_the_eta_counts_tokens_left_at_the_current_rate() -> None:
    now = Current(generated_tokens_per_second=1000.0, in_flight=32)
    e = estimate(_progress(), now)
    # 500 left x 100 tokens each, less what the 32 in flight generated already (50 each), at 1,000 tok/s.
    assert e.state == "tokens"
    assert e.remaining_tokens == 500 * 100 - 32 * 50
    assert e.eta_seconds == pytest.approx(48.4)
    # Before five requests finished, answers are expected to run to max_tokens.
    early = estimate(_progress(completed=2, completion_tokens=20, counted_completion_tokens=3000), now)
    assert early.expected_completion_tokens == 256.0 and early.eta_seconds is not None
    assert estimate(_progress(counted_seconds=3.0), now).state == "estimating"
    assert estimate(_progress(completed=0, max_completion_tokens=None), now).state == "estimating"
    assert estimate(_progress(), Current()).state == "stalled"
    assert estimate(_progress(pending=0), now).state == "done"
    assert estimate(_progress(), now, terminal=True).eta_seconds is None


def test_a_job_that_generates_nothing_counts_its_prompt_tokens_left() -> None:
    """Embeddings: tokens left = pending x the finished requests' mean prompt tokens x the share computed (not
    cached), at the prompt tokens per second now; generating nothing is not a stall."""
    embed = {"max_completion_tokens": 0.0, "completion_tokens": 0, "counted_completion_tokens": 0}
    p = _progress(pending=50, completed=50, prompt_tokens=5000, cached_tokens=1000, **embed)
    e = estimate(p, Current(prompt_tokens_per_second=400.0, in_flight=8))
    assert (e.state, e.basis, e.remaining_tokens) == ("tokens", "prompt", 50 * 100 * 4 // 5)
    assert e.eta_seconds == pytest.approx(10.0) and e.to_dict()["basis"] == "prompt"
    assert estimate(p, Current()).state == "stalled"
    assert estimate(_progress(completed=3, prompt_tokens=300, **embed), Current(400.0)).state == "estimating"
    assert estimate(_progress(), Current(generated_tokens_per_second=1000.0)).basis == "generated"


def test_the_engines_counters_match_its_run_totals_and_move_before_anything_finishes(tiny_loaded) -> None:  # type: ignore[no-untyped-def]
    from omlx_jobs.worker.engine.config import EngineConfig
    from omlx_jobs.worker.engine.contract import Control, Hooks
    from omlx_jobs.worker.engine.loop import Engine
    from omlx_jobs.worker.engine.sequence import WorkItem
    from tests.test_engine import greedy, mixed_prompts

    engine = Engine(tiny_loaded, EngineConfig(completion_batch_size=4, prefill_batch_size=2, min_shared_tokens=8))
    prompts = mixed_prompts(tiny_loaded)
    seen: list[tuple[int, int, int]] = []
    finished: list[int] = []

    def control() -> Control:
        if not finished:
            seen.append(engine.live.snapshot())
        return Control.RUN

    totals = []
    for _ in range(2):  # two runs: the counters add up across them
        stats = engine.run(
            [WorkItem(i, p, greedy(12)) for i, p in enumerate(prompts)],
            Hooks(lambda rs: finished.extend(r.key for r in rs), control=control),
        )
        totals.append((stats.prefill_tokens, stats.generation_tokens))
    prefilled, generated, in_flight = engine.live.snapshot()
    assert (prefilled, generated) == (sum(t[0] for t in totals), sum(t[1] for t in totals))
    assert in_flight == 0 and generated == 2 * 12 * len(prompts)
    # While the first requests were still generating, tokens were already counted and requests in flight.
    assert max(s[1] for s in seen) > 0 and max(s[2] for s in seen) > 0 and max(s[0] for s in seen) > 0
