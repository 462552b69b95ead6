"""Prefix-aware ordering and cutting (jobs/sharding.py): pure logic, no Redis, SQL or MLX."""

from __future__ import annotations

import itertools
import random

import pytest

from omlx_jobs.jobs.sharding import (
    CHUNK_CHARS,
    Cut,
    canonical_text,
    cut_shards,
    prefix_key,
    request_key,
    shared_units,
)

CHAT = "/v1/chat/completions"
SYSTEMS = [f"You are assistant number {i}. " * 6 for i in range(5)]  # 5 long system prompts (>64 chars)


def chat(system: str | None, user: str) -> dict[str, object]:
    msgs = [{"role": "user", "content": user}]
    if system is not None:
        msgs.insert(0, {"role": "system", "content": system})
    return {"messages": msgs}


def test_canonical_text_puts_system_first_and_separates_endpoints() -> None:
    a = canonical_text(CHAT, {"messages": [{"role": "user", "content": "q"}, {"role": "system", "content": "S"}]})
    b = canonical_text(CHAT, {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "q"}]})
    assert a == b and a.startswith("c\x1dsystem\x1fS")
    assert canonical_text("/v1/completions", {"prompt": "system"}) != canonical_text("/v1/completions", {"prompt": [1]})
    assert shared_units(request_key(CHAT, chat("x" * 200, "a")), request_key("/v1/completions", {"prompt": "x"})) == 0


def test_keys_share_a_unit_per_shared_chunk_and_stay_small() -> None:
    base = "z" * 1000
    a, b = prefix_key(base + "apple"), prefix_key(base + "banana")
    assert shared_units(a, b) == sum(1 for _ in _whole_chunks(1000))
    assert shared_units(a, a) == len(a) // 4
    assert len(prefix_key("q" * 1_000_000)) == 4 * len(CHUNK_CHARS) <= 200
    assert shared_units(prefix_key("abc"), prefix_key("abd")) == 0  # inside the first chunk: no shared unit
    assert shared_units(None, a) == 0


def _whole_chunks(chars: int) -> list[int]:
    out, total = [], 0
    for size in CHUNK_CHARS:
        if total + size > chars:
            break
        total += size
        out.append(size)
    return out


def test_sorting_by_key_puts_requests_of_a_prefix_group_next_to_each_other() -> None:
    rng = random.Random(0)
    bodies = [chat(rng.choice(SYSTEMS), f"question {i}") for i in range(200)]
    bodies += [chat(None, f"no system {i}") for i in range(20)]
    rng.shuffle(bodies)
    order = sorted(range(len(bodies)), key=lambda i: (request_key(CHAT, bodies[i]), i))
    systems = [bodies[i]["messages"][0]["content"] if len(bodies[i]["messages"]) == 2 else None for i in order]
    runs = [s for j, s in enumerate(systems) if j == 0 or s != systems[j - 1]]
    assert all(runs.count(s) == 1 for s in SYSTEMS)  # each system prompt's requests form one run


def _keys(groups: list[int]) -> list[bytes]:
    """Sorted keys of requests in groups of the given sizes (each group: one shared 1,000-char prefix)."""
    keys = []
    for g, n in enumerate(groups):
        keys += [prefix_key(f"{g:04d}" * 250 + f"user {i}") for i in range(n)]
    return sorted(keys)


def test_cuts_are_contiguous_cover_everything_and_respect_the_size_bounds() -> None:
    rng = random.Random(1)
    for _ in range(50):
        groups = [rng.randint(1, 300) for _ in range(rng.randint(1, 12))]
        size = rng.randint(1, 200)
        keys = _keys(groups)
        cuts = list(cut_shards(keys, size))
        assert cuts[0].first == 0 and cuts[-1].end == len(keys)
        assert all(a.end == b.first for a, b in itertools.pairwise(cuts))
        assert all(max(1, size // 2) <= c.end - c.first <= size + size // 2 for c in cuts[:-1])
        assert cuts[-1].end - cuts[-1].first <= size + size // 2


def _group_bounds(keys: list[bytes]) -> list[int]:
    """Positions where a new prefix group starts (no key chunk shared with the previous key), and the end."""
    return [i for i in range(len(keys)) if i == 0 or shared_units(keys[i - 1], keys[i]) == 0] + [len(keys)]


def test_groups_that_fit_are_never_cut() -> None:
    # Groups of 40..120 requests with shards of about 100: every cut falls on a group boundary.
    keys = _keys([40, 120, 60, 90, 100, 45, 75])
    cuts = list(cut_shards(keys, 100))
    assert {c.end for c in cuts} <= set(_group_bounds(keys))
    assert all(c.group_first == c.group_last or c.lead_rows + c.tail_rows <= c.end - c.first for c in cuts)


def test_a_large_group_spans_shards_and_they_say_so() -> None:
    keys = _keys([30, 500, 30])
    bounds = _group_bounds(keys)
    big = next(g for g in range(3) if bounds[g + 1] - bounds[g] == 500)
    cuts = list(cut_shards(keys, 100))
    spanning = [c for c in cuts if big in (c.group_first, c.group_last)]
    assert len(spanning) >= 4
    # Consecutive shards inside the group continue it: the next shard's first group is this one's last.
    for a, b in itertools.pairwise(spanning):
        assert a.group_last == b.group_first == big
    inner = spanning[1:-1]
    assert all(c.lead_rows == c.tail_rows == c.end - c.first for c in inner)  # wholly inside the group
    assert (
        sum(c.tail_rows if c.group_last == big else 0 for c in spanning[:1])
        + sum(c.end - c.first for c in inner)
        + sum(c.lead_rows for c in spanning[-1:])
        == 500
    )


def test_a_group_is_split_where_it_branches_highest() -> None:
    # One 1,000-char prefix with two sub-prefixes of 150 and 150 rows: a cut near 150 lands on the branch.
    keys = sorted(
        [prefix_key("S" * 1000 + "A" * 600 + f"{i}") for i in range(150)]
        + [prefix_key("S" * 1000 + "B" * 600 + f"{i}") for i in range(150)]
    )
    first = next(cut_shards(keys, 150))
    assert first.end == 150


def test_identical_prompts_stay_together() -> None:
    keys = sorted([prefix_key("same prompt")] * 10 + [prefix_key(f"other {i}" * 20) for i in range(30)])
    for c in cut_shards(keys, 8):
        rows = keys[c.first : c.end]
        if prefix_key("same prompt") in rows:
            assert rows.count(prefix_key("same prompt")) == 10 or c.end - c.first == 12


@pytest.mark.parametrize("size", [0, -1])
def test_a_bad_size_is_refused(size: int) -> None:
    with pytest.raises(ValueError):
        list(cut_shards([b""], size))


def test_one_request_is_one_shard() -> None:
    assert list(cut_shards([prefix_key("x")], 10)) == [Cut(0, 1, 0, 0, 1, 1)]
