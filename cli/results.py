"""`results`: a job's OpenAI batch output lines, in input order, to stdout or a file."""

from __future__ import annotations

import sys

import click

from omlx_jobs.cli.common import client_errors, fail, open_store, silence_stdout
from omlx_jobs.cli.options import db_option


@click.command("results")
@click.argument("job_id")
@click.option(
    "-o",
    "--output",
    metavar="FILE",
    help="Output file; '-' or nothing: stdout. Devices and FIFOs (/dev/stdout, a named pipe) are written "
    "through. An existing file is replaced only with --force; a symbolic link is written through into its "
    "target only with --force (the link stays).",
)
@click.option(
    "--errors",
    metavar="FILE",
    help="Write failed/cancelled requests here (default: into the output); never the same file as --output.",
)
@click.option("--force", is_flag=True, help="Overwrite existing files (and write through symbolic links).")
@db_option
def results(job_id: str, output: str | None, errors: str | None, force: bool, db: str | None) -> None:
    """Write results as OpenAI batch output JSONL, in input order."""
    from omlx_jobs.jobs.export import StdoutClosed, write_results

    try:
        counts = write_results(open_store(db, create=False), job_id, output, errors, force=force)
    except StdoutClosed:
        silence_stdout()  # the reader (e.g. `| head`) has what it wanted
        sys.exit(1)
    except client_errors() as exc:
        if output in (None, "-"):
            silence_stdout()
        fail(str(exc))
        return
    where = f" to {output}" if output not in (None, "-") else ""
    msg = f"wrote {counts.written} result(s){where}"
    if counts.errors:
        msg += f", {counts.errors} error line(s)" + (f" to {errors}" if errors else "")
    if counts.pending:
        msg += f"; {counts.pending} request(s) not finished yet"
    click.echo(msg, err=True)
