"""`worker` and `run`: the commands that load a model (MLX is imported only inside them).

`load_engine` is the one place the CLI turns --model and the engine options into an engine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
from pathlib import Path
from typing import Any

import click

from omlx_jobs import defaults
from omlx_jobs.cli.common import connect_redis, fail, open_store, set_verbosity, verbosity_options
from omlx_jobs.cli.options import (
    MODEL_NAME_HELP,
    Size,
    db_option,
    format_size,
    image_access,
    image_options,
    redis_option,
)
from omlx_jobs.cli.render import print_rejection, run_progress, status_lines


def engine_options(fn: Any) -> Any:
    """--model and the engine's options (batch sizes, prefill step, caches, context length): worker and run."""
    opts = [
        click.option("--model", "-m", required=True, help="Model directory, Hugging Face id, or gguf:FILE.gguf."),
        click.option("--model-name", help=MODEL_NAME_HELP),
        click.option(
            "--batch-size",
            default=defaults.BATCH_SIZE,
            show_default=True,
            help="Sequences decoded together. On an NVIDIA GPU try 128: decoding is about 2.8x faster at 1k-token "
            "contexts (bench/kernels/decode_step.py); the KV cache grows with it.",
        ),
        click.option(
            "--prefill-batch-size",
            default=defaults.PREFILL_BATCH_SIZE,
            show_default=True,
            help="Prompts prefilled together, at least (more while they fit 8,192 tokens; docs/configuration.md).",
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
        click.option(
            "--speculation",
            type=click.Choice(["auto", "off"]),
            help="Speculative decoding from each request's own prompt and output, on per row while it pays "
            "(docs/speculation.md, which says why off is the default for now). Env OMLX_JOBS_SPECULATION.",
        ),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def load_engine(kw: dict[str, Any], images: Any = None) -> Any:
    """The engine for the engine options in `kw`: the model loaded, and the engine that runs it."""
    from omlx_jobs.worker import loading
    from omlx_jobs.worker.engine.config import EngineConfig

    switches = defaults.Switches.from_env()
    if kw.get("speculation"):
        switches = dataclasses.replace(switches, speculation=kw["speculation"])
    config = EngineConfig(
        switches=switches,
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
    return loading.load_engine(kw["model"], config, context_length=kw["context_length"], images=images)


@click.command("worker")
@engine_options
@click.option(
    "--queue",
    help="Queue to serve (default: the model's keyed queue, and the one named after --model as spelled, for jobs "
    "queued before queues were keyed), with its :high and :low queues, high first.",
)
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
@verbosity_options
def worker(
    queue: str | None,
    burst: bool,
    drain_timeout: float,
    name: str | None,
    heartbeat_ttl: int,
    db: str | None,
    redis_url: str | None,
    verbose: int,
    quiet: int,
    **kw: Any,
) -> None:
    """Serve jobs for one model: load it once, drain shards with continuous batching and prefix reuse.

    Logs a line per shard started and finished and a line a minute while busy (-q: warnings only, -v: more).
    """
    set_verbosity(verbose, quiet)
    from omlx_jobs.jobs.queue import RedisUnavailable, queue_name
    from omlx_jobs.store import StoreError

    images = image_access(kw)
    try:
        redis = connect_redis(redis_url)
        store = open_store(db)
    except (RedisUnavailable, StoreError) as exc:
        fail(str(exc))
        return
    from omlx_jobs.worker import entry
    from omlx_jobs.worker.models.paths import ModelLoadError
    from omlx_jobs.worker.runtime.rq_worker import serve

    try:
        engine = load_engine(kw, images)
    except (ModelLoadError, ValueError) as exc:
        fail(str(exc))
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


@click.command("run")
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
@verbosity_options
def run(
    file: Path,
    output: str,
    errors: str | None,
    skip_invalid: bool,
    force: bool,
    resume_job: str | None,
    db: str | None,
    verbose: int,
    quiet: int,
    **kw: Any,
) -> None:
    """Run FILE locally in this process, without Redis, on the same engine and store; write OUT."""
    set_verbosity(verbose, quiet, talk=logging.WARNING)  # the progress bar says what the shard lines would
    from omlx_jobs.jobs.export import OutputError, check_distinct, destination, write_results
    from omlx_jobs.jobs.submit import load_job
    from omlx_jobs.store import StoreError

    images = image_access(kw)
    try:  # checked before any work: a refused output path must not cost a whole run
        check_distinct(destination(output, force=force), destination(errors, force=force) if errors else None)
    except OutputError as exc:
        fail(str(exc))
        return
    from omlx_jobs.worker.models.paths import ModelLoadError

    try:
        store = open_store(db)
        try:  # the model first: a bad --model leaves no job behind
            engine = load_engine(kw, images)
        except (ModelLoadError, ValueError) as exc:
            fail(str(exc))
            return
        if resume_job:
            job_id = resume_job
        else:
            load = load_job(
                store, file, kw["model"], skip_invalid=skip_invalid, images=images, model_name=kw["model_name"]
            )
            if load.rejected:
                print_rejection(load)
                sys.exit(2)
            job_id = load.job_id
        click.echo(f"job {job_id}", err=True)
        run_local(store, engine, job_id)
        counts = write_results(store, job_id, output, errors, force=True)
    except (OutputError, StoreError) as exc:
        fail(str(exc))
        return
    click.echo(
        f"wrote {counts.written} result(s) to {output}" + (f", {counts.errors} error line(s)" if counts.errors else ""),
        err=True,
    )


def run_local(store: Any, engine: Any, job_id: str) -> None:
    """Run every pending request of a job in this process with a progress bar, then print its status."""
    from omlx_jobs.jobs import lifecycle
    from omlx_jobs.worker.runtime import shard

    counts = store.counts(job_id)
    done = {"n": counts.total - counts.pending}
    with run_progress() as bar:
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
            fail(
                f"the engine failed ({type(exc).__name__}: {exc}); finished results are stored. Continue with "
                f"--resume {job_id}, or run with -vv to see where"
            )
    status = lifecycle.finalize_if_done(store, job_id)
    summary = lifecycle.summarize(store.get_job(job_id), store.counts(job_id))
    click.echo("\n".join(status_lines(summary)), err=True)
    if status not in lifecycle.TERMINAL:
        click.echo(f"job {job_id} is {status}", err=True)
