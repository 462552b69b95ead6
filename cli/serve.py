"""`serve`: OpenAI's Files and Batches API, the web page and /metrics (api/), under uvicorn."""

from __future__ import annotations

from pathlib import Path

import click

from omlx_jobs.cli.common import fail
from omlx_jobs.cli.options import Size, db_option, redis_option
from omlx_jobs.jobs.sharding import DEFAULT_SHARD_SIZE


@click.command("serve")
@click.option(
    "--host", default="127.0.0.1", show_default=True, help="Address to listen on; beyond loopback a key is required."
)
@click.option("--port", default=8000, show_default=True, type=int, help="Port to listen on (0 picks a free one).")
@click.option(
    "--api-key",
    "api_keys",
    multiple=True,
    metavar="KEY",
    help="A bearer key clients must send (repeatable). Env: OMLX_JOBS_API_KEYS (comma-separated). "
    "Without any, the server answers only on loopback. Keys are tenants: each sees only the files and batches "
    "it created (another key's answer 404).",
)
@click.option(
    "--admin-api-key",
    "admin_api_keys",
    multiple=True,
    metavar="KEY",
    help="A key that sees and acts on every key's files and batches (repeatable). "
    "Env: OMLX_JOBS_ADMIN_API_KEYS (comma-separated).",
)
@click.option(
    "--model",
    "models",
    multiple=True,
    metavar="NAME=MODEL",
    help="Let batches name MODEL (a worker's --model string) as NAME in body.model (repeatable; a bare MODEL is "
    "its own name). Models that live workers serve are accepted by their own name without this.",
)
@click.option(
    "--files-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="The server's own folder for uploaded files (default: <data dir>/files, e.g. ~/.local/share/omlx-jobs/files).",
)
@click.option(
    "--max-upload-bytes",
    type=Size(),
    default="512MB",
    show_default=True,
    help="Largest file POST /v1/files takes (413 over it).",
)
@click.option(
    "--max-upload-lines",
    type=int,
    default=1_000_000,
    show_default=True,
    help="Most lines an uploaded file may have (413 over it).",
)
@click.option(
    "--shard-size",
    type=click.IntRange(min=1),
    default=DEFAULT_SHARD_SIZE,
    show_default=True,
    help="Requests per shard for batches created here (as `submit --shard-size`).",
)
@db_option
@redis_option
def serve(
    host: str,
    port: int,
    api_keys: tuple[str, ...],
    admin_api_keys: tuple[str, ...],
    models: tuple[str, ...],
    files_dir: Path | None,
    max_upload_bytes: int | None,
    max_upload_lines: int,
    shard_size: int | None,
    db: str | None,
    redis_url: str | None,
) -> None:
    """Serve OpenAI's Files and Batches API, a web page at / and /metrics (needs omlx-jobs[serve]).

    The official openai client works with base_url=http://HOST:PORT/v1. Batches land on the same queues as
    `submit`, so `omlx-jobs worker --model MODEL` runs them.
    """
    try:
        import uvicorn

        from omlx_jobs.api import ServeConfig, create_app
        from omlx_jobs.api.config import ADMIN_API_KEYS_ENV, ConfigError, check_listen, parse_api_keys, parse_models
    except ImportError as exc:
        fail(f"the server needs its extra ({exc.name} is missing): pip install 'omlx-jobs[serve]'")
        return
    from omlx_jobs.jobs.queue import resolve_redis_url
    from omlx_jobs.store import StoreError, default_database_url
    from omlx_jobs.store.db import data_dir

    try:
        keys = parse_api_keys(api_keys)
        admin = parse_api_keys(admin_api_keys, env_name=ADMIN_API_KEYS_ENV)
        check_listen(host, keys + admin)
        url = db if db and "://" in db else default_database_url(db)
        config = ServeConfig(
            db_url=url,
            redis_url=resolve_redis_url(redis_url),
            files_dir=files_dir or data_dir() / "files",
            api_keys=keys,
            admin_keys=admin,
            models=parse_models(models),
            max_upload_bytes=max_upload_bytes or 512 * 1024**2,
            max_upload_lines=max_upload_lines,
            shard_size=shard_size,
        )
        app = create_app(config)
    except (ConfigError, StoreError) as exc:
        fail(str(exc))
        return
    auth = f"{len(keys)} API key(s), {len(admin)} admin" if keys or admin else "no API key (loopback only)"
    click.echo(f"serving on http://{host}:{port} ({auth}); the page is at /, the API at /v1", err=True)
    uvicorn.run(app, host=host, port=port, log_level="info", proxy_headers=False, server_header=False)
