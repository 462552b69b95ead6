"""What the commands print: the status text, tables of jobs and workers, rejections, progress bars."""

from __future__ import annotations

import time
from typing import Any

import click

from omlx_jobs.cli.common import stderr_console


def format_status(s: dict[str, Any]) -> str:
    """The text `status` prints for a job summary (jobs.lifecycle.summarize)."""
    rc = s["request_counts"]
    u = s["usage"]
    t = s["throughput"]
    p = s["prefix"]
    lines = [
        f"job        {s['id']}",
        f"model      {s['model']}",
        f"status     {s['status']}",
        f"requests   {rc['completed']} completed, {rc['failed']} failed, {rc['cancelled']} cancelled, "
        f"{rc['pending']} pending / {rc['total']} total ({s['progress']:.0%})",
        f"tokens     prompt {u['prompt_tokens']} (cached {u['prompt_tokens_details']['cached_tokens']}), "
        f"completion {u['completion_tokens']}",
        f"throughput {t['completion_tokens_per_second']} tok/s, {t['requests_per_second']} req/s "
        f"over {t['elapsed_seconds']}s",
    ]
    if s["eta_seconds"] is not None:
        lines.append(f"eta        {s['eta_seconds']:.0f}s")
    if p["trie_min_tokens"]:
        lines.append(
            f"prefix     computed {p['prefill_tokens_computed']} / minimum {p['trie_min_tokens']} prompt tokens "
            f"= {p['efficiency']}x; cache hits {p['cache_hits']}, misses {p['cache_misses']}, "
            f"evictions {p['cache_evictions']}, peak {p['cache_peak_bytes'] / 1e6:.1f} MB"
        )
    if s["errors"]:
        lines.append(
            f"errors     {len(s['errors'])} input error(s), first: line {s['errors'][0]['line']}: "
            f"{s['errors'][0]['message']}"
        )
    if s.get("priority", "normal") != "normal":
        lines.append(f"priority   {s['priority']}")
    for w in s.get("workers") or []:
        lines.append(f"worker     {w['worker']}: {w['completed']} completed, {w['failed']} failed ({w['model']})")
    live = s.get("live_workers")
    if live == 0 and s["status"] not in ("completed", "failed", "cancelled"):
        lines.append(
            f"waiting    no live worker serves {s['queue']}: start one with `omlx-jobs worker --model {s['model']}`"
        )
    return "\n".join(lines)


def print_rejection(load: Any) -> None:
    """A rejected file on stderr: the count, the first 50 errors, and what to do."""
    click.echo(f"rejected {load.job_id}: {load.invalid} bad line(s); nothing was queued.", err=True)
    for err in load.errors[:50]:
        click.echo(f"  {err}", err=True)
    if len(load.errors) > 50:
        click.echo(f"  ... and {load.invalid - 50} more (omlx-jobs status {load.job_id} --json)", err=True)
    click.echo("Fix the lines, or pass --skip-invalid to run the good ones.", err=True)


def jobs_table(rows: list[tuple[Any, Any]]) -> list[str]:
    """The lines `jobs` prints for (JobInfo, JobCounts) pairs: a header, then each job and its requests done."""
    lines = [f"{'JOB':34} {'STATUS':12} {'DONE':>13}  {'CREATED':19}  MODEL"]
    for job, c in rows:
        done = f"{c.done}/{c.total}"
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(job.created_at))
        lines.append(f"{job.id:34} {job.status:12} {done:>13}  {created}  {job.model}")
    return lines


def workers_table(workers: list[Any], now: float) -> list[str]:
    """The lines `workers` prints: a header, then one line per live worker."""
    lines = [f"{'WORKER':34} {'STATE':8} {'TOK/S':>8} {'DONE':>8} {'BEAT':>6}  {'JOB / SHARD':44} MODEL"]
    for w in workers:
        running = f"{w.job_id} [{w.shard}]" if w.job_id else "-"
        beat = f"{max(0, now - w.last_heartbeat):.0f}s"
        rate = f"{w.tokens_per_second:.1f}"
        lines.append(f"{w.name:34} {w.state:8} {rate:>8} {w.requests_done:>8} {beat:>6}  {running:44} {w.model}")
    return lines


def job_progress() -> Any:
    """The bar `submit --wait` shows: the job and its status, requests done of all, time left."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    return Progress(*columns, console=stderr_console(), transient=False)


def run_progress() -> Any:
    """The bar `run` shows: requests done of all, time elapsed."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    return Progress(*columns, console=stderr_console())
