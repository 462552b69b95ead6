"""The prefix planner on hand-made tries: order, warm-up points, trie minimum. Pure: no MLX."""

from __future__ import annotations

from omlx_jobs.worker.engine.planner import WarmUp, plan
from omlx_jobs.worker.prompts import common_prefix, key_tokens, token_key


def keys(*prompts: list[int]) -> list[bytes]:
    return [token_key(p) for p in prompts]


def test_token_key_round_trips_and_orders_like_tokens() -> None:
    a, b = [1, 2, 300000], [1, 2, 4]
    assert key_tokens(token_key(a)) == a
    assert (token_key(a) < token_key(b)) == (a < b)
    assert common_prefix(token_key([5, 6, 7, 8]), token_key([5, 6, 9])) == 2
    assert common_prefix(token_key([5, 6]), token_key([5, 6, 9])) == 2
    assert common_prefix(token_key([]), token_key([1])) == 0


def test_order_is_depth_first_so_siblings_run_together() -> None:
    sys_a = list(range(100, 120))
    sys_b = list(range(200, 220))
    prompts = [sys_a + [1], sys_b + [1], sys_a + [2], sys_b + [2], [7, 7, 7]]
    p = plan(keys(*prompts), min_shared_tokens=4)
    assert p.order == [4, 0, 2, 1, 3]
    assert p.warmups == [WarmUp(depth=20, first=1, last=2), WarmUp(depth=20, first=3, last=4)]


def test_trie_minimum_counts_distinct_tokens() -> None:
    # Trie: [1,2,3] shared, then [4] / [5,6]; plus a disjoint [9]; a duplicate adds nothing.
    prompts = [[1, 2, 3, 4], [1, 2, 3, 5, 6], [9], [1, 2, 3, 4]]
    p = plan(keys(*prompts), min_shared_tokens=1)
    assert p.trie_min_tokens == 3 + 1 + 2 + 1
    assert p.prompt_tokens == 4 + 5 + 1 + 4


def test_nested_warmups_parent_before_child() -> None:
    base = list(range(50, 70))  # 20 shared tokens
    prompts = [base + [1, 1, 1, 1, 1, 9], base + [1, 1, 1, 1, 1, 8], base + [2]]
    p = plan(keys(*prompts), min_shared_tokens=16)
    # Sorted: base+[1..,8], base+[1..,9], base+[2]; nodes: depth 20 over all three, depth 25 over the first two.
    assert p.order == [1, 0, 2]
    assert p.warmups == [WarmUp(depth=20, first=0, last=2), WarmUp(depth=25, first=0, last=1)]


def test_short_shared_prefixes_are_not_warmed() -> None:
    p = plan(keys([1, 2, 3, 4], [1, 2, 3, 5]), min_shared_tokens=4)
    assert p.warmups == []
    p = plan(keys([1, 2, 3, 4], [1, 2, 3, 5]), min_shared_tokens=3)
    assert p.warmups == [WarmUp(depth=3, first=0, last=1)]


def test_identical_prompts_share_the_whole_prompt() -> None:
    # n > 1 expands to identical keys; they form one node as deep as the prompt.
    prompt = list(range(10, 40))
    p = plan(keys(prompt, prompt, prompt, prompt), min_shared_tokens=16)
    assert p.warmups == [WarmUp(depth=30, first=0, last=3)]
    assert p.trie_min_tokens == 30


def test_a_prompt_that_prefixes_another_is_a_node() -> None:
    turn1 = list(range(100, 130))
    turn2 = turn1 + list(range(300, 320))
    turn3 = turn2 + list(range(400, 410))
    p = plan(keys(turn3, turn1, turn2), min_shared_tokens=16)
    assert p.order == [1, 2, 0]
    assert p.warmups == [WarmUp(depth=30, first=0, last=2), WarmUp(depth=50, first=1, last=2)]
    assert p.trie_min_tokens == 60


def test_empty_and_single() -> None:
    assert plan([], 4).order == []
    p = plan(keys([1, 2, 3]), 1)
    assert p.order == [0] and p.warmups == [] and p.trie_min_tokens == 3


def test_warmup_rounds_fold_chains_and_compute_branch_points_first() -> None:
    from omlx_jobs.worker.engine.planner import WarmupTask, warmup_rounds

    # A conversation chain: turn1 ⊂ turn2 ⊂ turn3 nodes fold into one pass of the deepest.
    t1, t2, t3 = WarmUp(30, 0, 3), WarmUp(50, 1, 3), WarmUp(70, 2, 3)
    assert warmup_rounds([t3, t1, t2]) == [[WarmupTask(t3, (t1, t2))]]
    # A system prompt shared by two sub-groups is computed once, before them.
    root, left, right = WarmUp(20, 0, 9), WarmUp(25, 0, 4), WarmUp(26, 5, 9)
    assert warmup_rounds([left, right, root]) == [[WarmupTask(root)], [WarmupTask(left), WarmupTask(right)]]
    # Independent groups share a round.
    a, b = WarmUp(20, 0, 3), WarmUp(20, 4, 7)
    assert warmup_rounds([a, b]) == [[WarmupTask(a), WarmupTask(b)]]


def test_identical_short_prompts_still_share() -> None:
    short = [5, 6, 7]  # under min_shared_tokens, but the same whole prompt three times (n=3)
    p = plan(keys(short, short, short, [5, 6, 8]), min_shared_tokens=16)
    assert p.warmups == [WarmUp(depth=3, first=0, last=2)]


def test_nested_warmups_must_add_enough_tokens() -> None:
    # Questions that begin alike after a long document: "Question 1" is shared by q1 and q10, one token past the
    # part all questions share. A warm-up there would hold a copy of the whole document to save one token a row.
    doc = list(range(1000, 1100))
    prompts = [doc + [5, 1, 7], doc + [5, 1, 0, 8], doc + [5, 2, 9]]
    assert plan(keys(*prompts), min_shared_tokens=16).warmups == [
        WarmUp(depth=101, first=0, last=2),
        WarmUp(depth=102, first=0, last=1),
    ]
    p = plan(keys(*prompts), min_shared_tokens=16, min_added_tokens=16)
    assert p.warmups == [WarmUp(depth=101, first=0, last=2)]
    assert p.trie_min_tokens == 101 + 1 + 2 + 1 + 2  # the minimum is the trie's, whatever is warmed up
    # A nested node far enough past its parent stays; so does a prompt that several sequences have in full.
    far = [doc + list(range(20)) + [1], doc + list(range(20)) + [2], doc + [7], doc + [7]]
    p = plan(keys(*far), min_shared_tokens=16, min_added_tokens=16)
    assert p.warmups == [
        WarmUp(depth=100, first=0, last=3),
        WarmUp(depth=120, first=0, last=1),
        WarmUp(depth=101, first=2, last=3),
    ]
