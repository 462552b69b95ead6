"""Options several commands share: --db, --redis-url, where images may come from, and the SIZE type."""

from __future__ import annotations

import re
from typing import Any

import click

SIZE_UNITS = {"": 1, "B": 1, "K": 1024, "KB": 1024, "M": 1024**2, "MB": 1024**2, "G": 1024**3, "GB": 1024**3}


def parse_size(text: str) -> int | None:
    """'2GB' -> bytes; 'none' or 'unbounded' -> None."""
    if text.strip().lower() in ("none", "unbounded", "inf"):
        return None
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?B?)\s*", text.upper())
    if not m:
        raise click.BadParameter(f"{text!r} is not a size; use e.g. 512MB, 2GB or 'none'")
    return int(float(m.group(1)) * SIZE_UNITS[m.group(2)])


def format_size(n: int) -> str:
    """Bytes as parse_size reads them back, in the largest whole unit: 2147483648 -> '2GB'."""
    for unit in ("GB", "MB", "KB"):
        if n and n % SIZE_UNITS[unit] == 0:
            return f"{n // SIZE_UNITS[unit]}{unit}"
    return str(n)


class Size(click.ParamType):
    """A byte count written as 512MB, 2GB or 'none' (unbounded)."""

    name = "SIZE"

    def convert(self, value: Any, param: Any, ctx: Any) -> int | None:
        if value is None or isinstance(value, int):
            return value
        return parse_size(str(value))


db_option = click.option(
    "--db",
    envvar="OMLX_JOBS_DB",
    metavar="PATH|URL",
    help="SQLite file (default: ~/.local/share/omlx-jobs/omlx-jobs.db) or a SQLAlchemy URL. "
    "Env: OMLX_JOBS_DB; OMLX_JOBS_DATABASE_URL takes any URL.",
)
redis_option = click.option(
    "--redis-url",
    envvar="OMLX_JOBS_REDIS_URL",
    metavar="URL",
    help="Redis URL (redis://, rediss:// for TLS; passwords in the URL). Default redis://127.0.0.1:6379/0. "
    "Env: OMLX_JOBS_REDIS_URL.",
)


def image_options(fn: Any) -> Any:
    """--allow-files-from and --allow-remote-images: where images in messages may come from (submit and worker)."""
    opts = [
        click.option(
            "--allow-files-from",
            "allow_files_from",
            multiple=True,
            type=click.Path(file_okay=False),
            metavar="DIR",
            help="Images in messages may be files under DIR (repeatable). Symlinks and .. are resolved first; "
            "the worker checks again with its own list.",
        ),
        click.option(
            "--allow-remote-images",
            is_flag=True,
            help="Images in messages may be http(s) URLs (fetched by the worker, 10 s timeout, 20 MB cap).",
        ),
        click.option(
            "--allow-remote-hosts",
            "allow_remote_hosts",
            multiple=True,
            metavar="HOST|CIDR",
            help="With --allow-remote-images: a host name, address or network (repeatable) that images may come "
            "from although it is loopback, private or otherwise internal (refused by default).",
        ),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def image_access(kw: dict[str, Any]) -> Any:
    """The ImageAccess for --allow-files-from / --allow-remote-images (popped from kw)."""
    from omlx_jobs.jobs.images import ImageAccess

    dirs, remote = kw.pop("allow_files_from", ()), kw.pop("allow_remote_images", False)
    try:
        return ImageAccess.create(dirs, allow_remote=remote, allow_remote_hosts=kw.pop("allow_remote_hosts", ()))
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


MODEL_NAME_HELP = "The model's short name in lists, the page and /metrics (default: its folder's or GGUF file's stem)."
