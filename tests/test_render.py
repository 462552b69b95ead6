"""The client commands' text (cli/render.py), pure: a job that ended short is never 100% done, live figures
and the ETA read as they should, workers show their current rates."""

from __future__ import annotations

from omlx_jobs.cli.render import done_cell, duration, requests_line, worker_lines
from omlx_jobs.jobs.workers import WorkerInfo
from omlx_jobs.store.db import JobCounts


def _counts(completed: int, failed: int, cancelled: int, pending: int) -> JobCounts:
    total = completed + failed + cancelled + pending
    return JobCounts(total, pending, completed, failed, cancelled, 0, 0, 0, None, None)


def test_a_job_that_ended_short_is_never_all_done() -> None:
    rc = {"total": 65, "completed": 1, "failed": 1, "cancelled": 63, "pending": 0}
    assert requests_line(rc, "cancelled").endswith("(1.5% completed)")
    assert requests_line({**rc, "completed": 3, "cancelled": 0, "pending": 61}, "in_progress").endswith("(6.2% done)")
    assert requests_line({"total": 0, "completed": 0, "failed": 0, "cancelled": 0, "pending": 0}, "failed").endswith(
        "(nothing ran)"
    )
    assert done_cell(_counts(1, 1, 63, 0), "cancelled") == "1/65 ok, 1 failed, 63 cancelled"
    assert done_cell(_counts(64, 0, 0, 1), "in_progress") == "64/65"
    assert done_cell(_counts(65, 0, 0, 0), "completed") == "65/65"


def test_workers_show_their_current_rates_and_short_model_names() -> None:
    w = WorkerInfo(name="w1", model="gguf:/m/SmolLM2-135M-Instruct.Q4_1.gguf", state="busy", job_id="batch_x",
                   shard="0-64", tokens_per_second=108.2, prompt_tokens_per_second=420.0, in_flight=32,
                   last_heartbeat=100.0)  # fmt: skip
    header, line = worker_lines([w], now=103.0)
    assert "PROMPT/S" in header and "GEN/S" in header and "FLIGHT" in header
    assert "420.0" in line and "108.2" in line and " 32 " in line and "3s" in line
    assert line.endswith("SmolLM2-135M-Instruct.Q4_1") and "/m/" not in line
    assert [duration(s) for s in (None, 5, 200, 7300, 90000)] == ["-", "5s", "3m 20s", "2h 1m", "1d 1h"]
