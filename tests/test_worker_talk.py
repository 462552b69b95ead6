"""A worker that talks: its INFO lines (shards started and finished, the minute line, why it exits), -v/-q on the
`worker` and `run` commands, the reconnect limiter, and the tokenizer's length warning silenced.

The lines' wording and the limiter are pure logic, tested here without a worker; a real burst worker on the tiny
model and the tests' own Redis shows the lines in its stderr.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from omlx_jobs.cli import cli
from omlx_jobs.cli.common import TALK_LOGGERS, levels
from omlx_jobs.jobs.live import Rates
from omlx_jobs.worker.engine.limits import LENGTH_WARNING, TOKENIZER_LOGGER, silence_tokenizer_length_warning
from omlx_jobs.worker.engine.results import RunStats
from omlx_jobs.worker.runtime import report
from omlx_jobs.worker.runtime.reconnects import ReconnectFilter, RedisState, quiet_reconnects, reached
from omlx_jobs.worker.runtime.shard import ShardOutcome


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# ---- pure: levels, lines, the minute line, the limiter --------------------------------------------------------


def test_verbosity_levels() -> None:
    info, warning, error, debug = logging.INFO, logging.WARNING, logging.ERROR, logging.DEBUG
    assert levels(0) == (warning, info)  # worker: its own lines at INFO, the rest at WARNING
    assert levels(0, talk=warning) == (warning, warning)  # run: the progress bar says it
    assert levels(1) == (info, info) and levels(1, talk=warning) == (info, info)
    assert levels(2) == (debug, debug) == levels(5)
    assert levels(-1) == (warning, warning) and levels(-2) == (error, error) == levels(-4)


def test_the_cli_names_the_report_logger() -> None:
    assert (report.log.name,) == TALK_LOGGERS


def test_shard_lines() -> None:
    assert report.started_line("batch_a", 64, 128) == "shard batch_a[64:128] started, 64 requests"
    assert report.started_line("batch_a", 0, None) == "shard batch_a[all] started"
    stats = RunStats(prefill_tokens=900, generation_tokens=10, cache_hits=3, cache_misses=1)
    outcome = ShardOutcome("batch_a", 0, 64, completed=60, failed=4, stats=stats)
    line = report.finished_line(outcome, generated=2000, seconds=4.0)
    assert line == (
        "shard batch_a[0:64] finished: 60 completed, 4 failed, 2,000 tokens generated, 900 prefilled in 4.0s "
        "(500.0 tok/s), cache hit rate 75%"
    )
    stopped = ShardOutcome("batch_a", 0, 64, completed=50, left_pending=14, stopped=True, stats=RunStats())
    line = report.finished_line(stopped, generated=None, seconds=0.0)
    assert line.startswith("shard batch_a[0:64] stopped: 50 completed, 0 failed, 0 tokens")
    assert line.endswith("(0.0 tok/s), cache hit rate -")


def test_stop_lines() -> None:
    assert report.stop_line("stop requested", 8, 3, 120) == (
        "worker exiting (stop requested): 3 shard(s), 120 request(s) done; 8 request(s) went back to the queue"
    )
    assert report.stop_line("--burst", 0, 0, 0).endswith("; nothing went back to the queue")


def test_a_busy_worker_speaks_once_a_minute(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    talk = report.BusyTalk(clock=clock)

    class Stats:
        hits, misses = 10, 10

    rates = Rates(prompt_tokens_per_second=300.0, generated_tokens_per_second=120.5, in_flight=32)
    caplog.set_level(logging.INFO, logger=report.log.name)
    assert talk.maybe("batch_a", rates, Stats) is None  # just became busy
    clock.now += 59
    assert talk.maybe("batch_a", rates, Stats) is None
    clock.now += 1
    Stats.hits, Stats.misses = 19, 11  # 9 hits and 1 miss in the last minute
    line = talk.maybe("batch_a", rates, Stats)
    assert line == ("busy on batch_a: 32 in flight, 120.5 tok/s generated, 300.0 tok/s prefilled, cache hit rate 90%")
    assert caplog.messages == [line]
    clock.now += 30
    assert talk.maybe("batch_a", rates, Stats) is None  # the next one a minute after the last
    talk.idle()
    clock.now += 600
    assert talk.maybe("batch_b", rates, Stats) is None  # a new shard starts its own minute


def test_redis_state_reports_changes_only() -> None:
    clock = Clock()
    state = RedisState(clock)
    assert state.up() is None  # up and up: no change
    assert state.down() is True
    clock.now += 5
    assert state.down() is False and state.down() is False
    clock.now += 7
    assert state.up() == 12.0
    assert state.up() is None
    assert state.down() is True  # a new outage is a change again


def record(name: str, msg: str, level: int = logging.ERROR) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, msg, (), None)


def test_the_filter_lets_one_reconnect_line_through_per_outage() -> None:
    state = RedisState(Clock())
    noise = ReconnectFilter(state)
    rq_line = "Worker %s: could not connect to Redis instance: %s retrying in %d seconds..."
    first = record("rq.worker", rq_line)
    assert noise.filter(first) and "not logged until Redis is back" in first.msg
    assert not noise.filter(record("rq.worker", rq_line))
    assert not noise.filter(record("omlx_jobs.worker.runtime.rq_worker", "Redis unreachable (%s); retrying in %.0fs"))
    assert not noise.filter(record("omlx_jobs.worker.runtime.rq_worker", "heartbeat failed (%s); retrying"))
    assert noise.filter(record("rq.worker", "Worker %s: found an unhandled exception"))  # other lines pass
    state.up()
    assert noise.filter(record("rq.worker", rq_line))  # the next outage's first line


def test_quiet_reconnects_filters_rqs_logger_and_says_when_redis_is_back(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    state = RedisState(clock)
    caplog.set_level(logging.INFO)
    with quiet_reconnects(state):
        for _ in range(5):
            logging.getLogger("rq.worker").error("Worker w: could not connect to Redis instance: refused")
        clock.now += 42
        reached(state)
        reached(state)
    logging.getLogger("rq.worker").error("Worker w: could not connect to Redis instance: after serve")
    assert [m.split(":")[-1].split(" (")[0] for m in caplog.messages] == [
        " refused",
        "Redis is reachable again after 42s",
        " after serve",  # the filter is gone once the worker stops serving
    ]


def test_the_tokenizer_length_warning_is_dropped() -> None:
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, rec: logging.LogRecord) -> None:
            seen.append(rec.getMessage())

    logger = logging.getLogger(TOKENIZER_LOGGER)
    handler = Keep()
    logger.addHandler(handler)
    try:
        silence_tokenizer_length_warning()
        silence_tokenizer_length_warning()  # once is enough; twice changes nothing
        logger.warning(f"{LENGTH_WARNING} the specified maximum sequence length for this model (900 > 512)")
        logger.warning("another tokenizer warning")
    finally:
        logger.removeHandler(handler)
    assert seen == ["another tokenizer warning"]


# ---- the CLI: -v/-q on the commands ---------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["worker", "run"])
def test_worker_and_run_take_v_and_q(command: str) -> None:
    out = CliRunner().invoke(cli, [command, "--help"]).output
    assert "-v, --verbose" in out and "-q, --quiet" in out
    assert "-q, --quiet" in CliRunner().invoke(cli, ["--help"]).output  # and the group keeps its flags


# ---- a real worker ----------------------------------------------------------------------------------------------


@pytest.fixture
def env(tmp_path: Path, redis_url: str) -> dict[str, str]:
    e = {
        **os.environ,
        "OMLX_JOBS_DB": str(tmp_path / "jobs.db"),
        "OMLX_JOBS_REDIS_URL": redis_url,
        "OMLX_JOBS_HOME": str(tmp_path / "home"),
    }
    e.pop("OMLX_JOBS_DATABASE_URL", None)
    return e


def worker(env: dict[str, str], model: Path, *flags: str, group: tuple[str, ...] = ()) -> str:
    cmd = [sys.executable, "-m", "omlx_jobs.cli", *group, "worker", "--model", str(model), "--burst", *flags]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stderr


def test_the_worker_says_what_it_does_at_info(tmp_path: Path, env: dict[str, str], tiny_model_dir: Path) -> None:
    src = tmp_path / "in.jsonl"
    lines = [{"prompt": f"Once upon a time {i}", "max_tokens": 4, "temperature": 0} for i in range(5)]
    lines.append({"prompt": "x" * 4000, "max_tokens": 3})  # over the tiny model's 512-token context
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    result = CliRunner().invoke(cli, ["submit", str(src), "--model", str(tiny_model_dir)], env=env)
    assert result.exit_code == 0, result.output
    job = result.stdout.strip()

    err = worker(env, tiny_model_dir)
    assert f"INFO omlx_jobs.worker.runtime.report: shard {job}[0:6] started, 6 requests" in err
    finished = next(x for x in err.splitlines() if f"shard {job}[0:6] finished" in x)
    assert ": 5 completed, 1 failed, " in finished and " tok/s), cache hit rate " in finished
    assert "worker exiting (--burst, and no work is left on its queues): 1 shard(s), 6 request(s) done" in err
    assert "nothing went back to the queue" in err
    # The prompt over the context failed as context_length_exceeded, without transformers' warning about it.
    assert "Token indices sequence length" not in err
    assert " INFO rq.worker" not in err and " INFO omlx_jobs.worker.runtime.shard" not in err  # -v shows those


def test_q_and_v_on_the_worker_command(env: dict[str, str], tiny_model_dir: Path) -> None:
    assert " INFO " not in worker(env, tiny_model_dir, "-q")
    assert " INFO " not in worker(env, tiny_model_dir, group=("-q",))
    loud = worker(env, tiny_model_dir, "-v")
    assert " INFO rq.worker" in loud and "worker exiting (--burst" in loud  # (`omlx-jobs -v worker`: fault_harness)
