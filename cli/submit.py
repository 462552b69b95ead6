"""`submit`: validate a JSONL file, store it, queue its shards; print the job id (and wait, if asked)."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click

from omlx_jobs import defaults
from omlx_jobs.cli.common import client_errors, connect_redis, fail, open_store
from omlx_jobs.cli.options import MODEL_NAME_HELP, db_option, image_access, image_options, redis_option
from omlx_jobs.cli.render import job_progress, print_rejection
from omlx_jobs.jobs.sharding import DEFAULT_SHARD_SIZE


@click.command("submit")
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--model", "-m", required=True, help="The model a worker serves (same string as `worker --model`).")
@click.option("--model-name", help=MODEL_NAME_HELP)
@click.option("--queue", help="Queue name (default: omlx:<short name>-<hash of the resolved model>).")
@click.option("--skip-invalid", is_flag=True, help="Run the valid lines; record bad ones as failed requests.")
@click.option("--wait", is_flag=True, help="Show a progress bar until the job finishes.")
@click.option(
    "--shard-size",
    type=click.IntRange(min=1),
    default=DEFAULT_SHARD_SIZE,
    show_default=True,
    help="Requests per shard, the unit one worker takes. Requests sharing a prompt prefix are ordered next to "
    "each other, and shards are cut between such groups where they can (each between half and 1.5 times this "
    "size), so several workers share a job and each keeps its prefixes cached.",
)
@click.option(
    "--priority",
    type=click.Choice(["high", "normal", "low"]),
    default="normal",
    show_default=True,
    help="Workers take shards of high-priority jobs first, then normal, then low (the queue's :high and :low "
    "companions).",
)
@click.option(
    "--shard-timeout", type=int, default=defaults.SHARD_TIMEOUT, show_default=True, help="Seconds a shard may run."
)
@image_options
@db_option
@redis_option
def submit(
    file: Path,
    model: str,
    model_name: str | None,
    queue: str | None,
    skip_invalid: bool,
    wait: bool,
    shard_size: int,
    priority: str,
    shard_timeout: int,
    db: str | None,
    redis_url: str | None,
    **kw: Any,
) -> None:
    """Validate FILE (JSONL: OpenAI batch lines or {"prompt"|"messages": ...}) and queue it; prints the job id.

    Ctrl-C (or SIGTERM) while it reads leaves no job behind: the half-stored one is removed.
    """
    from omlx_jobs.jobs import actions

    images = image_access(kw)
    try:
        redis = connect_redis(redis_url)
        store = open_store(db)
        with signals_interrupt():
            result = actions.submit(
                store,
                redis,
                file,
                model,
                queue=queue,
                priority=priority,
                skip_invalid=skip_invalid,
                shard_size=shard_size,
                shard_timeout=shard_timeout,
                images=images,
                model_name=model_name,
            )
    except KeyboardInterrupt:
        fail("submit interrupted; nothing was queued and no job was kept", code=130)
        return
    except client_errors() as exc:
        fail(str(exc))
        return
    load = result.load
    if load.rejected:
        print_rejection(load)
        sys.exit(2)
    if load.invalid:
        click.echo(f"{load.invalid} invalid line(s) recorded as failed requests:", err=True)
        for err in load.errors[:20]:
            click.echo(f"  {err}", err=True)
    click.echo(f"queued {load.valid} request(s) on {result.queue}", err=True)
    click.echo(load.job_id)
    if wait:
        wait_for(store, load.job_id)


@contextlib.contextmanager
def signals_interrupt() -> Iterator[None]:
    """SIGTERM and SIGHUP raise KeyboardInterrupt, as Ctrl-C does, so cleanup code runs for them too."""
    import signal

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    saved = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def wait_for(store: Any, job_id: str) -> None:
    """A progress bar on stderr until the job reaches a final status, then that status."""
    from omlx_jobs.jobs import lifecycle

    with job_progress() as bar:
        task = bar.add_task(job_id, total=None)
        while True:
            job, counts = store.get_job(job_id), store.counts(job_id)
            bar.update(task, total=counts.total, completed=counts.done, description=f"{job_id} {job.status}")
            if job.status in lifecycle.TERMINAL:
                break
            time.sleep(1)
    click.echo(f"{job_id}: {store.get_job(job_id).status}", err=True)
