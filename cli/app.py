"""The click group: version, logging level, and every command, each from its own module."""

from __future__ import annotations

import contextlib
import logging
import sys

import click

from omlx_jobs import __version__
from omlx_jobs.cli import control, models, results, serve, status, submit, worker, workers
from omlx_jobs.cli.common import LOG_FORMAT, levels, silence_stdout


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="omlx-jobs")
@click.option("-v", "--verbose", count=True, help="More logging (-vv for debug).")
@click.option("-q", "--quiet", count=True, help="Less logging (the worker's INFO lines off; -qq: errors only).")
@click.pass_context
def cli(ctx: click.Context, verbose: int, quiet: int) -> None:
    """Batch inference jobs for MLX: submit JSONL, drain it with workers, export OpenAI batch output.

    Quick start without Redis:  omlx-jobs run examples/sample.jsonl --model MODEL -o results.jsonl
    """
    ctx.obj = {"verbosity": verbose - quiet}  # `worker` and `run` add their own -v/-q to it
    logging.basicConfig(level=levels(verbose - quiet)[0], format=LOG_FORMAT)


for command in (
    submit.submit,
    status.status,
    status.list_jobs,
    results.results,
    control.cancel,
    control.retry,
    control.resume,
    workers.list_live_workers,
    serve.serve,
    worker.worker,
    worker.run,
    models.models,
):
    cli.add_command(command)


def main() -> None:
    """The console script `omlx-jobs`."""
    try:
        cli()
    except OSError as exc:  # stdout or stderr failed past the commands' own handling (`jobs > /dev/full`)
        silence_stdout()
        with contextlib.suppress(OSError):
            click.echo(f"error: cannot write the output: {exc.strerror or exc}", err=True)
        sys.exit(1)
