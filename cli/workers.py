"""`workers`: the live workers, from their heartbeat records in Redis (jobs.workers)."""

from __future__ import annotations

import json

import click

from omlx_jobs.cli.common import client_errors, connect_redis, fail
from omlx_jobs.cli.options import redis_option
from omlx_jobs.cli.render import worker_lines


@click.command("workers")
@click.option("--json", "as_json", is_flag=True, help="Print the workers as JSON.")
@redis_option
def list_live_workers(as_json: bool, redis_url: str | None) -> None:
    """List live workers: model, state, current job and shard, tokens per second, last heartbeat.

    Each worker refreshes its record with its heartbeat; a worker that stops or dies drops out of this list
    within about a minute (--heartbeat-ttl plus the idle poll).
    """
    from omlx_jobs.jobs.workers import list_workers

    try:
        workers = list_workers(connect_redis(redis_url))
    except client_errors() as exc:
        fail(str(exc))
        return
    if as_json:
        click.echo(json.dumps([w.to_dict() for w in workers], indent=2))
        return
    if not workers:
        click.echo("no live workers: start one with `omlx-jobs worker --model M`")
        return
    for line in worker_lines(workers):
        click.echo(line)
