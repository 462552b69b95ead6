"""Prefix cache policy: longest-prefix lookup, trimming, byte budget and eviction order. Pure: no MLX."""

from __future__ import annotations

from omlx_jobs.worker.cache.prefix_cache import PrefixCache
from omlx_jobs.worker.prompts import token_key

A = list(range(1000, 1020))  # 20 tokens


def k(tokens: list[int]) -> bytes:
    return token_key(tokens)


def test_longest_prefix_and_trim() -> None:
    c = PrefixCache(max_bytes=None, trimmable=True, bucket_tokens=4)
    c.add(k(A), "short", 10)
    c.add(k(A + [1, 2, 3, 4, 5]), "long", 10)
    m = c.lookup(k(A + [1, 2, 3, 9]))
    assert m is not None and m.entry.value == "long" and m.length == 23  # trimmed to the shared part
    m = c.lookup(k(A + [1, 2, 3, 4, 5, 6]), limit=22)
    assert m is not None and m.length == 22
    assert c.lookup(k([7, 7, 7, 7, 7])) is None
    assert c.stats.hits == 2 and c.stats.misses == 1


def test_untrimmable_caches_use_whole_prefixes_only() -> None:
    c = PrefixCache(max_bytes=None, trimmable=False, bucket_tokens=4)
    c.add(k(A), "short", 10)
    c.add(k(A + [1, 2, 3, 4, 5]), "long", 10)
    m = c.lookup(k(A + [1, 2, 3, 9]))
    assert m is not None and m.entry.value == "short" and m.length == 20
    m = c.lookup(k(A + [1, 2, 3, 4, 5, 6]), limit=24)
    assert m is not None and m.entry.value == "short"


def test_eviction_finished_subtrees_first_then_lru() -> None:
    c = PrefixCache(max_bytes=300, trimmable=True, bucket_tokens=4)
    e1 = c.add(k(A + [1]), "e1", 100, needed_until=5)  # needed until position 5
    e2 = c.add(k(A + [2]), "e2", 100, needed_until=50)
    e3 = c.add(k(A + [3]), "e3", 100, needed_until=2)
    c.lookup(k(A + [3, 0]))  # e3 most recently used
    c.advance(10)  # e1 and e3 hold finished subtrees now; e2 is still needed
    assert [e.value for e in c.eviction_order()] == ["e1", "e3", "e2"]
    c.add(k(A + [4]), "e4", 100, needed_until=60)
    assert "e1" not in {e.value for e in c.entries()}  # finished and least recently used
    assert c.stats.evictions == 1
    c.add(k(A + [5]), "e5", 150, needed_until=70)
    values = {e.value for e in c.entries()}
    assert values == {"e4", "e5"} and c.stats.bytes == 250  # e3 (finished) then e2 (LRU) went
    assert e1.key not in c and e2.key not in c and e3.key not in c


def test_pinned_entries_stay_even_over_budget() -> None:
    c = PrefixCache(max_bytes=100, trimmable=True, bucket_tokens=4)
    big = c.add(k(A + [1]), "big", 500, pin=True)
    assert big.key in c  # in use right now: kept, though over the budget
    c.unpin(big)
    c.evict_to_fit()
    assert big.key not in c and c.stats.bytes == 0
    c.add(k(A + [2]), "too-big-unpinned", 500)
    assert len(c) == 0 and c.stats.evictions == 2
    assert c.stats.peak_bytes == 500


def test_replacing_an_entry_keeps_bytes_right() -> None:
    c = PrefixCache(max_bytes=None, bucket_tokens=4)
    c.add(k(A), "v1", 10)
    c.add(k(A), "v2", 30)
    assert len(c) == 1 and c.stats.bytes == 30 and c.get(k(A)).value == "v2"


def test_a_run_keeps_only_the_top_of_each_tree() -> None:
    # The nodes under a shared prefix belong to their run's groups; keeping them made a worker's memory grow
    # with every shard it ran (issue 10). The tops (system prompts) stay for the next shard and job.
    c = PrefixCache(max_bytes=None, trimmable=True, bucket_tokens=4)
    B = [7] * 20
    c.start_run()
    for key in (A, A + [1, 2], A + [1, 2, 3], A + [5], B, B + [9]):
        c.add(k(key), "v", 10, needed_until=3)
    c.end_run()
    assert sorted(e.key for e in c.entries()) == sorted([k(A), k(B)]) and c.stats.bytes == 20
