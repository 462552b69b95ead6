"""How many queued rows a prompt pass takes, and when a running batch refills (worker/backend/decode.py): pure."""

from __future__ import annotations

from omlx_jobs.worker.backend.decode import prefill_rows, refill_now


def _queue(*lengths: int) -> list[tuple[int, list[list[int]]]]:
    """BatchGenerator's queue entries: (uid, prompt segments), the last token a segment of its own."""
    return [(i, [[1] * (n - 1), [1]]) for i, n in enumerate(lengths)]


def test_short_suffixes_fill_the_token_budget() -> None:
    assert prefill_rows(_queue(*[40] * 300), rows=8, tokens=8192, step=2048) == 204  # 204 x 40 <= 8192 < 205 x 40


def test_never_fewer_rows_than_the_floor() -> None:
    assert prefill_rows(_queue(*[2000] * 20), rows=8, tokens=8192, step=2048) == 8
    assert prefill_rows(_queue(40, 40), rows=8, tokens=8192, step=2048) == 8


def test_the_longest_row_so_far_pads_the_pass_and_a_chunk_caps_it() -> None:
    assert prefill_rows(_queue(10, 10, 1000, 10), rows=1, tokens=2500, step=2048) == 2  # 3 x 1000 > 2500
    assert prefill_rows(_queue(*[9000] * 4), rows=1, tokens=8192, step=2048) == 4  # 4 x 2048 fits


def test_a_running_batch_refills_once_an_eighth_is_free_or_when_under_half() -> None:
    assert not refill_now(127, 128, 16)
    assert not refill_now(113, 128, 16)
    assert refill_now(112, 128, 16)
    assert refill_now(63, 128, 16)
    assert refill_now(31, 32, 1)
    assert not refill_now(32, 32, 1)
