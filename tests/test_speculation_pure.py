"""Speculation's pure parts: the n-gram proposer, the acceptance rules and the cost controller (no MLX)."""

from __future__ import annotations

from omlx_jobs.worker.speculation.acceptance import greedy_accepted, sampled_accepted
from omlx_jobs.worker.speculation.controller import RowController, Speculation, StepCosts
from omlx_jobs.worker.speculation.proposer import NgramProposer


def test_proposer_drafts_what_followed_the_last_match() -> None:
    p = NgramProposer([1, 2, 3, 4, 5, 6, 9, 9, 3, 4], min_n=2)
    assert p.propose(3) == [5, 6, 9]
    assert p.propose(1) == [5]
    assert p.propose(0) == []


def test_proposer_prefers_the_longest_match_then_the_most_recent() -> None:
    # (3, 4) occurs twice before the end: after 2 3 4 (longer match with the suffix 2 3 4) and after 7 3 4.
    p = NgramProposer([2, 3, 4, 10, 11, 7, 3, 4, 20, 2, 3, 4], min_n=2, max_n=6)
    assert p.propose(2) == [10, 11]
    q = NgramProposer([3, 4, 10, 3, 4, 20, 3, 4], min_n=2, max_n=6)
    assert q.propose(2) == [20, 3]  # equal matches: the most recent


def test_proposer_needs_min_n_tokens_matched_and_stays_in_the_history() -> None:
    assert NgramProposer([1, 2, 3, 4, 5, 3], min_n=2).propose(4) == []  # only "3" repeats
    assert NgramProposer([1, 2, 3, 4, 5, 3], min_n=1).propose(4) == [4, 5, 3]
    assert NgramProposer([5, 5], min_n=2).propose(4) == []
    # A draft may run up to the history's last token, never past it.
    assert NgramProposer([7, 8, 7, 8], min_n=2).propose(8) == [7, 8]


def test_proposer_retract_undoes_extend() -> None:
    p = NgramProposer([1, 2, 3, 1, 2], min_n=2)
    before = p.propose(4)
    p.extend([9])
    assert p.propose(4) == []
    p.retract()
    assert p.history == [1, 2, 3, 1, 2] and p.propose(4) == before == [3, 1, 2]


def test_speculation_drafts_follow_the_rows_cache_and_pending_token() -> None:
    spec = Speculation(k_max=4)
    assert spec.draft(7, [1, 2, 3, 4, 5, 1, 2, 3], 4, 4) == [5, 1, 2, 3]
    # The cache grew by the pending token and an accepted draft; the proposer follows without a rebuild.
    assert spec.draft(7, [1, 2, 3, 4, 5, 1, 2, 3, 4, 5], 1, 3) == [2, 3, 4]
    assert spec.rows[7][0].history == [1, 2, 3, 4, 5, 1, 2, 3, 4, 5]
    spec.forget([])
    assert spec.rows == {}


def test_acceptance_rules() -> None:
    assert greedy_accepted([5, 6, 7], [5, 6, 8, 1]) == 2
    assert greedy_accepted([5, 6], [5, 6, 2]) == 2
    assert greedy_accepted([5], [4, 2]) == 0
    assert sampled_accepted([0.9, 0.5, 0.9], [0.1, 0.6, 0.0]) == 1
    assert sampled_accepted([1.0, 1.0], [0.99, 0.0]) == 2
    assert sampled_accepted([0.0], [0.0]) == 0


def test_controller_switches_a_row_off_after_two_unprofitable_windows_and_probes_later() -> None:
    c = RowController(window=4, patience=2, probe=10)
    for step in range(4):  # one unprofitable window: still on
        assert c.wants(step) > 0
        c.record(step, 4, 0, charge=1.0)
    assert c.wants(4) > 0
    for step in range(4, 8):  # the second, ending at step 7: off for 10 steps
        c.record(step, 1, 0, charge=1.0)
    assert c.wants(8) == 0 and c.wants(16) == 0
    assert c.wants(17) > 0  # probed again
    for step in range(17, 25):  # two more losing windows: off twice as long
        c.record(step, 1, 0, charge=1.0)
    assert c.wants(25) == 0 and c.wants(43) == 0 and c.wants(44) > 0


def test_controller_keeps_a_paying_row_on_and_adapts_k() -> None:
    c = RowController(k_max=8, window=4, patience=2, probe=10)
    for step in range(40):
        k = c.wants(step)
        assert k > 0
        c.record(step, k, k, charge=1.0)
    assert c.k == 8
    c.record(40, 8, 2, charge=1.0)
    assert c.k == 3
    # A profitable window between two losing ones resets the count.
    d = RowController(window=1, patience=2, probe=10)
    d.record(0, 2, 0, 1.0)
    d.record(1, 2, 2, 1.0)
    d.record(2, 2, 0, 1.0)
    assert d.wants(3) > 0


def test_step_costs_measure_the_wider_step_against_a_plain_one() -> None:
    costs = StepCosts(smoothing=0.5)
    assert costs.ratio(1) == 1.0 and costs.ratio(5) > 1.0  # guessed before any measurement
    costs.observe(1, 0.010)
    costs.observe(5, 0.030)
    assert costs.ratio(5) == 3.0
    costs.observe(5, 0.010)
    assert costs.ratio(5) == 2.0
    # 8 rows, 2 drafting, a step costing 2 plain ones: each drafting row must gain 4 tokens to pay.
    assert costs.charges(5, 8, 2) == 4.0
