"""What the commands share beyond options: opening the store and Redis, one-line errors, the stderr console."""

from __future__ import annotations

import contextlib
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
