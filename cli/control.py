"""`cancel`, `retry` and `resume`: change what runs of a job, through jobs.actions."""

from __future__ import annotations

import click

from omlx_jobs.cli.common import client_errors, connect_redis, fail, open_store
from omlx_jobs.cli.options import db_option, redis_option


@click.command("cancel")
@click.argument("job_id")
@db_option
@redis_option
def cancel(job_id: str, db: str | None, redis_url: str | None) -> None:
    """Cancel a job: queued work is dropped, running requests stop, finished results are kept."""
    from omlx_jobs.jobs import actions
    from omlx_jobs.jobs.queue import RedisUnavailable

    try:
        store = open_store(db, create=False)
        store.get_job(job_id)  # an unknown id: one line, before Redis is asked
        try:
            redis = connect_redis(redis_url)
        except RedisUnavailable as exc:
            click.echo(f"warning: {exc}; cancelling in the store only", err=True)
            redis = None
        click.echo(actions.cancel_report(store, redis, job_id))
    except client_errors() as exc:
        fail(str(exc))


@click.command("retry")
@click.argument("job_id")
@click.option("--include-cancelled", is_flag=True, help="Also run requests that were cancelled.")
@db_option
@redis_option
def retry(job_id: str, include_cancelled: bool, db: str | None, redis_url: str | None) -> None:
    """Run a finished job's requests that failed on our side again (engine errors, too many attempts).

    Permanent failures stay failed: invalid input lines, prompts over the context, template errors.
    """
    from omlx_jobs.jobs import actions

    try:
        store = open_store(db, create=False)
        store.get_job(job_id)  # an unknown id: one line, before Redis is asked
        n = actions.retry(store, connect_redis(redis_url), job_id, include_cancelled=include_cancelled)
    except client_errors() as exc:
        fail(str(exc))
        return
    click.echo(f"{job_id}: {n} request(s) queued again" if n else f"{job_id}: nothing to retry")


@click.command("resume")
@click.argument("job_id")
@db_option
@redis_option
def resume(job_id: str, db: str | None, redis_url: str | None) -> None:
    """Enqueue a job again (after a submit that failed midway, or lost queue state).

    Refused while any of its shards is queued or running, as `retry` is for an unfinished job.
    """
    from omlx_jobs.jobs import actions

    try:
        store = open_store(db, create=False)
        store.get_job(job_id)
        ids = actions.resume(store, connect_redis(redis_url), job_id)
    except client_errors() as exc:
        fail(str(exc))
        return
    click.echo(f"{job_id}: enqueued {len(ids)} shard(s)")
