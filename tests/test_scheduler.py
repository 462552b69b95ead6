"""The scheduler and cache-entry lifetimes on plain data: admission order, pages, warm-up windows, pins.

Nothing here imports MLX (checked in a subprocess): prompts are token lists, cache values are strings.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest

from omlx_jobs.jobs.formats import SamplingParams
from omlx_jobs.worker.cache.lifetimes import LifetimeError, Lifetimes
from omlx_jobs.worker.cache.prefix_cache import Entry, PrefixCache
from omlx_jobs.worker.engine.planner import WarmUp, plan
from omlx_jobs.worker.engine.scheduler import Scheduler, Window
from omlx_jobs.worker.engine.sequence import WorkItem
from omlx_jobs.worker.prompts import token_key

SYS_A = list(range(100, 120))  # 20-token system prompts
SYS_B = list(range(200, 220))


def item(key: int, tokens: list[int], n: int = 1) -> WorkItem:
    return WorkItem(key, tokens, SamplingParams(n=n))


def shard() -> list[WorkItem]:
    """Two groups of three behind 20-token system prompts, interleaved in the input, and one loner."""
    tokens = [SYS_A + [1], SYS_B + [1], SYS_A + [2], SYS_B + [2], [7, 7, 7], SYS_A + [3], SYS_B + [3]]
    return [item(i, t) for i, t in enumerate(tokens)]


def drain(s: Scheduler, free: int) -> list[Window]:
    windows = []
    while not s.done:
        windows.append(s.next_window(free))
    return windows


def test_scheduler_imports_no_mlx() -> None:
    code = (
        "import sys\n"
        "import omlx_jobs.worker.engine.scheduler, omlx_jobs.worker.cache.lifetimes\n"
        "import omlx_jobs.worker.cache.prefix_cache\n"
        "import omlx_jobs.worker.engine.sequence, omlx_jobs.worker.engine.stopping, omlx_jobs.worker.engine.results\n"
        "import omlx_jobs.worker.prompts, omlx_jobs.worker.engine.planner\n"
        "bad = sorted(m for m in sys.modules if m == 'mlx' or m.startswith(('mlx.', 'mlx_lm')))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_admission_is_depth_first_and_fills_each_window() -> None:
    items = shard()
    s = Scheduler(items, window=4, reuse=True, min_shared_tokens=16)
    windows = drain(s, free=3)
    order = [a.work.key for w in windows for a in w.admissions]
    assert order == [items[i].key for i in plan([w.prompt.key for w in items], 16).order]
    assert order == [4, 0, 2, 5, 1, 3, 6]  # the loner, then group A together, then group B
    assert [len(w.admissions) for w in windows] == [3, 3, 1]
    assert [a.position for w in windows for a in w.admissions] == list(range(7))


def test_warmups_come_with_the_window_before_their_group() -> None:
    s = Scheduler(shard(), window=3, reuse=True, min_shared_tokens=16)
    first = s.next_window(free=1)  # position 0; the window looks ahead to positions 0..2
    assert [w.node for w in first.warmups] == [WarmUp(depth=20, first=1, last=3)]
    assert first.warmups[0].key == token_key(SYS_A)
    second = s.next_window(free=1)  # positions 1..3 ahead: group B (from 4) is not due yet
    assert second.warmups == []
    third = s.next_window(free=2)  # positions 2..4 ahead: group B starts at 4
    assert [w.node for w in third.warmups] == [WarmUp(depth=20, first=4, last=6)]


def test_without_reuse_order_is_input_order_and_nothing_is_warmed() -> None:
    same = [item(i, [5, 6, 7], n=2) for i in range(3)]  # identical prompts still make no warm-up
    s = Scheduler(same, window=8, reuse=False, min_shared_tokens=16)
    windows = drain(s, free=8)
    assert [(a.item, a.choice) for w in windows for a in w.admissions] == [(i, c) for i in range(3) for c in (0, 1)]
    assert all(w.warmups == [] for w in windows)


def test_pages_are_read_lazily_and_the_batch_stays_full_across_them() -> None:
    read: list[int] = []

    def lazily() -> Iterator[WorkItem]:
        for it in shard():
            read.append(it.key)
            yield it

    totals = []
    s = Scheduler(lazily(), window=4, reuse=True, min_shared_tokens=16, page_size=3, on_page=totals.append)
    s.read_ahead()
    assert len(read) == 6  # two pages: enough to know the next 4 positions
    window = s.next_window(free=4)
    assert len(window.admissions) == 4  # across the page boundary
    assert [a.position for a in window.admissions] == [0, 1, 2, 3]
    assert not s.input_exhausted
    rest = drain(s, free=4)
    assert len(read) == 7 and s.input_exhausted
    keys = [a.work.key for a in window.admissions] + [a.work.key for w in rest for a in w.admissions]
    assert sorted(keys) == list(range(7)) and len(keys) == 7
    assert [a.position for w in rest for a in w.admissions] == [4, 5, 6]
    assert sum(t.prompt_tokens for t in totals) == sum(len(it.tokens) for it in shard())
    assert len(totals) == 3  # one per page


def test_choices_of_an_item_run_together_and_unstarted_items_are_known() -> None:
    s = Scheduler([item(0, SYS_A + [1], n=3), item(1, [900, 900])], window=2, reuse=True, min_shared_tokens=16)
    first = s.next_window(free=2)
    assert [(a.item, a.choice) for a in first.admissions] == [(0, 0), (0, 1)]
    assert [w.node for w in first.warmups] == [WarmUp(depth=21, first=0, last=2)]  # the whole prompt, n = 3
    assert set(s.not_started()) == {1}  # item 0 has started (choice 2 waits); item 1 has not


def test_lifetimes_hold_until_the_last_position_and_misuse_raises() -> None:
    life = Lifetimes()
    entry = Entry(token_key(SYS_A), "kv", 10)
    life.hold(entry, until=3)
    life.hold(entry, until=5)
    assert entry.pins == 2 and entry.needed_until == 5
    assert life.advance(3) == [] and entry.pins == 2  # position 3 still needs it
    assert life.advance(4) == [entry] and entry.pins == 1
    assert not life.finished(entry)
    life.release_entry(entry)
    assert entry.pins == 0 and len(life) == 0
    with pytest.raises(LifetimeError):
        life.release_entry(entry)  # a double release is a bug, not a no-op
    life.advance(6)
    assert life.finished(entry)
    with pytest.raises(LifetimeError):
        life.advance(2)  # admission never goes back within a run
    life.hold(entry, until=9)
    with pytest.raises(LifetimeError):
        life.start_run([entry])  # a run that did not release its holds
    assert life.release_all() == [entry]
    life.start_run([entry])
    assert entry.needed_until == -1 and life.position == 0


def test_a_hold_until_released_outlives_positions_and_is_released_once() -> None:
    """How a row that reads a prefix entry in place (cascade attention) keeps it: a hold with no end position."""
    life = Lifetimes()
    entry = Entry(token_key(SYS_A), "kv", 10)
    by_position = life.hold(entry, until=2)
    by_row = life.hold(entry, until=None)
    assert life.advance(3) == [entry] and by_position.released and entry.pins == 1
    assert life.advance(100) == [] and entry.pins == 1  # the row still reads it
    life.release(by_row)
    assert entry.pins == 0 and len(life) == 0
    with pytest.raises(LifetimeError):
        life.release(by_row)
    early = life.hold(entry, until=200)
    life.release(early)  # released by hand before its position: advance does not release it again
    assert life.advance(300) == [] and entry.pins == 0


def simulate(cache: PrefixCache) -> dict[str, int]:
    """The engine's use of the scheduler, with strings for KV caches; returns where each entry was let go."""
    cache.start_run()
    s = Scheduler(shard(), window=3, reuse=True, min_shared_tokens=16)
    released_at: dict[str, int] = {}
    while not s.done:
        window = s.next_window(free=2)
        for w in window.warmups:
            cache.add(w.key, f"kv{w.node.first}", 10, needed_until=w.node.last, pin=True)
        for a in window.admissions:
            held = [e for e in cache.entries() if e.pins]
            cache.advance(a.position)
            released_at.update({e.value: a.position for e in held if e.pins == 0})
            match = cache.lookup(a.work.prompt.key, limit=len(a.work.prompt))
            if a.work.key != 4:  # the loner shares nothing
                assert match is not None and match.length == 20, a
    return released_at


def test_a_simulated_run_pins_each_prefix_exactly_for_its_group() -> None:
    cache = PrefixCache(max_bytes=None, bucket_tokens=16)
    # Group A (positions 1-3) lets go at 4; group B (4-6) is held until the run ends.
    assert simulate(cache) == {"kv1": 4}
    assert [e.pins for e in cache.entries()] == [0, 1]
    cache.end_run()
    assert [e.pins for e in cache.entries()] == [0, 0] and len(cache.lifetimes) == 0


def test_a_simulated_run_over_budget_evicts_finished_groups_only() -> None:
    cache = PrefixCache(max_bytes=15, bucket_tokens=16)  # room for one 10-byte entry when nothing is pinned
    assert simulate(cache) == {"kv1": 4}  # both pinned while needed, over budget; every admission still hit
    assert [e.value for e in cache.entries()] == ["kv4"] and cache.stats.evictions == 1  # A went once released
    cache.end_run()
    assert [e.value for e in cache.entries()] == ["kv4"]  # it fits alone


def test_cache_unpin_of_an_unheld_entry_raises() -> None:
    cache = PrefixCache(max_bytes=None, bucket_tokens=4)
    entry = cache.add(token_key(SYS_A), "kv", 10, needed_until=3)
    with pytest.raises(LifetimeError):
        cache.unpin(entry)
