"""What the commands share beyond options: opening the store and Redis, one-line errors, the stderr console, how
much is logged (-v / -q)."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import Any

import click


def open_store(db: str | None, *, create: bool = True) -> Any:
    """The store at --db; read-only commands pass create=False, so a wrong path never leaves a new database."""
    from omlx_jobs.store import open_store as open_at

    if db and "://" in db:
        return open_at(url=db, create=create)
    return open_at(db_path=db, create=create)


def connect_redis(url: str | None, *, check: bool = True) -> Any:
    """Redis at --redis-url (or its default), checked unless check=False."""
    from omlx_jobs.jobs.queue import connect

    return connect(url, check=check)


def stderr_console() -> Any:
    """Progress bars go to stderr, so stdout stays clean for job ids and results."""
    from rich.console import Console

    return Console(stderr=True)


TALK_LOGGERS = ("omlx_jobs.worker.runtime.report",)
"""The worker's own INFO lines (shards started and finished, the minute line, what a stop handed back): named, not
imported, so that no client command imports the worker package."""


def levels(verbosity: int, talk: int = logging.INFO) -> tuple[int, int]:
    """(the root logger's level, TALK_LOGGERS' level) for a verbosity: each -v adds one, each -q takes one.

    0: warnings, and the worker's lines at `talk` (INFO for `worker`, WARNING for `run`, whose progress bar says
    it); -v: INFO for everything, -vv: DEBUG; -q: warnings only; -qq: errors only.
    """
    if verbosity > 0:
        root = max(logging.WARNING - 10 * verbosity, logging.DEBUG)
        return root, min(root, talk)
    if verbosity == 0:
        return logging.WARNING, talk
    root = logging.WARNING if verbosity == -1 else logging.ERROR
    return root, max(root, logging.WARNING)


def set_verbosity(verbose: int, quiet: int, *, talk: int = logging.INFO) -> None:
    """Apply a command's -v/-q on top of the group's (`omlx-jobs -v worker` and `omlx-jobs worker -v` alike)."""
    ctx = click.get_current_context(silent=True)
    root_obj = ctx.find_root().obj if ctx is not None else None
    group = root_obj.get("verbosity", 0) if isinstance(root_obj, dict) else 0
    root, own = levels(group + verbose - quiet, talk)
    if not logging.getLogger().handlers:
        logging.basicConfig(format=LOG_FORMAT)
    logging.getLogger().setLevel(root)
    for name in TALK_LOGGERS:
        logging.getLogger(name).setLevel(own)


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def verbosity_options(fn: object) -> object:
    """-v/--verbose and -q/--quiet on a command itself (the group has them too)."""
    fn = click.option(
        "-q", "--quiet", count=True, help="Less logging: -q hides the worker's INFO lines, -qq warnings."
    )(fn)
    return click.option("-v", "--verbose", count=True, help="More logging (-vv for debug).")(fn)


def fail(message: str, code: int = 1) -> None:
    """Print `error: message` on stderr and exit with `code`."""
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


def client_errors() -> tuple[type[BaseException], ...]:
    """The errors a client command reports in one line: the store, Redis, refusals, output paths."""
    from omlx_jobs.jobs.export import OutputError
    from omlx_jobs.jobs.queue import RedisUnavailable
    from omlx_jobs.store import StoreError

    return (StoreError, RedisUnavailable, OutputError, ValueError)


def silence_stdout() -> None:
    """After stdout failed (a full disk, a closed pipe), point it at /dev/null, so Python's own flush at exit
    does not print a second, uglier error."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
