"""What the commands print, from plain values: the status text, the tables, sizes. Pure: no store, Redis or MLX."""

from __future__ import annotations

from types import SimpleNamespace

import click
import pytest

from omlx_jobs.cli.options import format_size, parse_size
from omlx_jobs.cli.render import job_lines, status_lines, worker_lines
from omlx_jobs.jobs import lifecycle
from omlx_jobs.store.jobs import JobCounts, JobInfo


def job(**fields: object) -> JobInfo:
    base: dict[str, object] = dict.fromkeys(JobInfo.__dataclass_fields__)
    base.update(id="batch_1", model="m", queue="omlx:m", input_file=None, status="in_progress", total=10)
    base.update(errors=None, options={}, created_at=1000.0, prefill_tokens=155, trie_min_tokens=155)
    base.update(cache_hits=9, cache_misses=1, cache_evictions=0, cache_peak_bytes=3_200_000)
    base.update(fields)
    return JobInfo(**base)  # type: ignore[arg-type]


def counts(**fields: int | float | None) -> JobCounts:
    base: dict[str, int | float | None] = dict(total=10, pending=4, completed=5, failed=1, cancelled=0)
    base.update(prompt_tokens=338, cached_tokens=183, completion_tokens=200)
    base.update(first_started_at=1000.0, last_finished_at=1010.0)
    base.update(fields)
    return JobCounts(**base)  # type: ignore[arg-type]


def test_counts_done_are_the_requests_with_a_final_status() -> None:
    assert counts(completed=5, failed=1, cancelled=2).done == 8


def test_status_text_shows_counts_tokens_prefix_and_a_missing_worker() -> None:
    text = "\n".join(status_lines(lifecycle.summarize(job(), counts(), now=1010.0, serving=0)))
    lines = text.splitlines()
    assert lines[0] == "job        batch_1"
    assert "requests   5 completed, 1 failed, 0 cancelled, 4 pending / 10 total (60.0% done)" in lines
    assert "tokens     prompt 338 (cached 183), completion 200 (finished requests)" in lines
    assert lines[-2].startswith("prefix     computed 155 prompt tokens so far; minimum 155")
    assert lines[-1].startswith("waiting    no live worker serves omlx:m: start one with `omlx-jobs worker")
    finished = "\n".join(
        status_lines(lifecycle.summarize(job(status="completed"), counts(pending=0, completed=9), serving=0))
    )
    assert "waiting" not in finished and "eta" not in finished


def test_tables_have_one_line_per_row_under_a_header() -> None:
    lines = job_lines([(job(), counts())])
    assert lines[0].split() == ["JOB", "STATUS", "DONE", "CREATED", "MODEL"]
    assert lines[1].split()[:5] == ["batch_1", "in_progress", "5/10", "ok,", "1"]
    worker = SimpleNamespace(
        name="w1", state="busy", prompt_tokens_per_second=80.0, tokens_per_second=12.34, in_flight=3,
        requests_done=7, last_heartbeat=95.0, job_id="batch_1", shard="0-10", model="/models/m", model_name="m",
    )  # fmt: skip
    lines = worker_lines([worker], now=100.0)
    assert lines[1].split() == ["w1", "busy", "80.0", "12.3", "3", "7", "5s", "batch_1", "[0-10]", "m"]


def test_sizes_read_back_as_written() -> None:
    assert parse_size("2GB") == 2 * 1024**3 and parse_size(" 512 mb ") == 512 * 1024**2
    assert parse_size("none") is None and parse_size("1.5K") == 1536
    assert all(parse_size(format_size(n)) == n for n in (1, 1024, 3 * 1024**2, 2 * 1024**3, 1000))
    with pytest.raises(click.BadParameter, match="not a size"):
        parse_size("two gigs")
