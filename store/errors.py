"""Store errors that say what to do, and the retry of SQLite's "database is locked"."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

from sqlalchemy.engine import make_url
from sqlalchemy.exc import DataError, IntegrityError, OperationalError, SQLAlchemyError, StatementError

from omlx_jobs.errors import OmlxError

P = ParamSpec("P")
T = TypeVar("T")

LOCK_RETRIES = 8


class StoreError(OmlxError, RuntimeError):
    """The database refused a write or read in a way the user must fix (disk full, read-only, unreachable)."""


class StoreUnavailable(StoreError):
    """The database server went away or refuses connections for now (a restart, a dropped connection): the
    worker waits and runs its shard again (worker/entry.py). A full disk or a read-only database is not this."""


class JobNotFound(StoreError):
    """No job with this id."""


class StoreMissing(StoreError):
    """A read-only command found no database (it never creates one)."""


# Raised while binding one row's values: the row is wrong, not the database.
_BIND_ERRORS = (OverflowError, UnicodeError, ValueError, TypeError)


def is_data_error(exc: BaseException) -> bool:
    """True when the database (or its driver) refused a value of the row, e.g. a number out of range.

    Such an error fails that row alone; anything else (locked, full, unreachable) is about the database.
    """
    if isinstance(exc, (DataError, IntegrityError)):
        return True
    if isinstance(exc, StatementError) and not isinstance(exc, OperationalError):
        return isinstance(exc.orig, _BIND_ERRORS)
    return isinstance(exc, _BIND_ERRORS)


# What PostgreSQL (libpq, psycopg) says when a connection is lost or the server is restarting.
_CONNECTION_LOST = (
    "server closed the connection",
    "terminating connection",
    "connection refused",
    "could not connect",
    "connection is closed",
    "connection already closed",
    "the connection is lost",
    "consuming input failed",
    "could not receive data",
    "could not send data",
    "no connection to the server",
    "ssl connection has been closed",
    "the database system is starting up",
    "the database system is shutting down",
    "the database system is in recovery mode",
    "cannot connect now",
    "connection timed out",
)


def connection_lost(exc: BaseException, text: str) -> bool:
    """True when `exc` says the server is gone for now, not that it refused what we asked."""
    if getattr(exc, "connection_invalidated", False):
        return True
    low = text.lower()
    return any(s in low for s in _CONNECTION_LOST)


def friendly(exc: SQLAlchemyError, url: str) -> StoreError:
    text = str(getattr(exc, "orig", exc) or exc)
    low = text.lower()
    full = ("disk" in low and ("full" in low or "space" in low)) or "no space" in low or "disk i/o error" in low
    readonly = "readonly" in low or "read-only" in low or "read only" in low
    if not full and not readonly and not url.startswith("sqlite") and connection_lost(exc, text):
        first = text.splitlines()[0] if text else type(exc).__name__
        hint = "the database server is unreachable for now: check that it runs, and --db / OMLX_JOBS_DATABASE_URL"
        return StoreUnavailable(f"{hint} ({safe_url(url)}): {first}")
    if "readonly" in low or "read-only" in low or "read only" in low:
        hint = "the database is read-only: check the file's permissions, or point --db elsewhere"
    elif ("disk" in low and ("full" in low or "space" in low)) or "no space" in low or "disk i/o error" in low:
        hint = "the disk is full or failing: free space, then run the command again (nothing finished is lost)"
    elif "locked" in low or "busy" in low:
        hint = "the database stayed locked: another process holds a long write; try again"
    elif "unable to open" in low or "could not connect" in low or "connection refused" in low:
        hint = "the database cannot be opened: check --db / OMLX_JOBS_DATABASE_URL and that the server runs"
    else:
        hint = "database error"
    return StoreError(f"{hint} ({safe_url(url)}): {text.splitlines()[0] if text else type(exc).__name__}")


def safe_url(url: str) -> str:
    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return url


def retrying(fn: Callable[P, T]) -> Callable[P, T]:
    """Retry SQLite 'database is locked' past the busy timeout, then raise a StoreError that says what to do."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
        store: Any = args[0]  # a Store: its url names the database in messages
        delay = 0.05
        for attempt in range(LOCK_RETRIES):
            try:
                return fn(*args, **kwargs)
            except OperationalError as exc:
                locked = "locked" in str(exc).lower() or "busy" in str(exc).lower()
                if not locked or attempt == LOCK_RETRIES - 1:
                    raise friendly(exc, store.url) from exc
                time.sleep(delay)
                delay = min(delay * 2, 2.0)
            except StoreError:
                raise
            except SQLAlchemyError as exc:
                raise friendly(exc, store.url) from exc
        raise AssertionError("unreachable")

    return wrapper
