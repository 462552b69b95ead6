"""`status` of one job and the list of recent `jobs`."""

from __future__ import annotations

import json
import time

import click

from omlx_jobs.cli.common import client_errors, connect_redis, fail, open_store
from omlx_jobs.cli.options import db_option, redis_option
from omlx_jobs.cli.render import job_lines, status_lines


def live_serving(redis_url: str | None, queue: str | None) -> int | None:
    """How many live workers listen on `queue`; None if Redis does not answer (status still works)."""
    from redis.exceptions import RedisError

    from omlx_jobs.jobs.queue import RedisUnavailable
    from omlx_jobs.jobs.workers import list_workers, serving

    if not queue:
        return None
    try:
        return len(serving(list_workers(connect_redis(redis_url)), queue))
    except (RedisUnavailable, RedisError, OSError):
        return None


@click.command("status")
@click.argument("job_id")
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON (with the workers that ran it).")
@click.option("--watch", is_flag=True, help="Refresh every 2 seconds until the job finishes.")
@db_option
@redis_option
def status(job_id: str, as_json: bool, watch: bool, db: str | None, redis_url: str | None) -> None:
    """Show a job's status, request counts, tokens, throughput, ETA, prefix efficiency and its workers.

    It also says when no live worker serves the job's queue (it asks Redis; without Redis it leaves that out).
    """
    from omlx_jobs.jobs import lifecycle
    from omlx_jobs.jobs.progress import job_status

    try:
        store = open_store(db, create=False)
        while True:
            job = store.get_job(job_id)
            live = None if job.status in lifecycle.TERMINAL else live_serving(redis_url, job.queue)
            summary = job_status(store, job_id, serving=live)
            if as_json:
                click.echo(json.dumps(summary, indent=None if watch else 2))
            else:
                if watch:
                    click.clear()
                click.echo("\n".join(status_lines(summary)))
            if not watch or summary["status"] in lifecycle.TERMINAL:
                break
            time.sleep(2)
    except client_errors() as exc:
        fail(str(exc))


@click.command("jobs")
@click.option("--limit", default=20, show_default=True)
@db_option
def list_jobs(limit: int, db: str | None) -> None:
    """List recent jobs."""
    from omlx_jobs.store.errors import StoreMissing

    try:
        store = open_store(db, create=False)
        rows = store.list_jobs(limit)
    except StoreMissing:
        rows = []
    except client_errors() as exc:
        fail(str(exc))
        return
    if not rows:
        click.echo("no jobs yet: `omlx-jobs submit FILE --model M` or `omlx-jobs run FILE --model M -o OUT`")
        return
    for line in job_lines((job, store.counts(job.id)) for job in rows):
        click.echo(line)
