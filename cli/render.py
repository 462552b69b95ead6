"""What the commands print: a job's status, the job list and the live workers as lines (pure, so tests read them
without a terminal), rejections, progress bars."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import click

from omlx_jobs.cli.common import stderr_console
from omlx_jobs.jobs import lifecycle
from omlx_jobs.jobs.model_names import display_name
from omlx_jobs.jobs.workers import WorkerInfo
from omlx_jobs.store.db import JobCounts, JobInfo

ENDED_SHORT = (lifecycle.FAILED, lifecycle.CANCELLED, lifecycle.EXPIRED)
"""Jobs that ended before every request completed: never shown as 100% done."""


def requests_line(rc: dict[str, int], status: str) -> str:
    """`3 completed, 1 failed, 61 cancelled, 0 pending / 65 total (4.6% completed)`; a running job says how much
    is done, one that ended short how much completed."""
    total = rc["total"]
    done = rc["completed"] + rc["failed"] + rc["cancelled"]
    if status in ENDED_SHORT:
        share = f"{rc['completed'] / total:.1%} completed" if total else "nothing ran"
    else:
        share = f"{done / total:.1%} done" if total else "no requests"
    return (
        f"{rc['completed']} completed, {rc['failed']} failed, {rc['cancelled']} cancelled, {rc['pending']} pending"
        f" / {total} total ({share})"
    )


def _eta_line(s: dict[str, Any]) -> str | None:
    eta = s.get("eta") or {}
    state = eta.get("state")
    if s["status"] in lifecycle.TERMINAL or state in (None, "done"):
        return None
    prompt = eta.get("basis") == "prompt"  # a job that generates nothing (embeddings): prompt tokens left
    if state == "estimating":
        return (
            "eta        estimating (too few requests finished yet)"
            if prompt
            else "eta        estimating (too little generated yet)"
        )
    if state == "stalled":
        what = "computed" if prompt else "generated"
        return f"eta        - (no tokens {what} in the last seconds)"
    left = "prompt tokens to compute" if prompt else "tokens to generate"
    return f"eta        {duration(eta['eta_seconds'])} (about {eta['remaining_tokens']:,} {left})"


def _rate(u: dict[str, Any], t: dict[str, Any]) -> str:
    """Generated tokens per second; for a job that generates nothing (embeddings), the prompt tokens'."""
    if u["completion_tokens"] == 0 and u["prompt_tokens"] and "prompt_tokens_per_second" in t:
        return f"{t['prompt_tokens_per_second']} embedded tok/s"
    return f"{t['completion_tokens_per_second']} tok/s"


def status_lines(s: dict[str, Any]) -> list[str]:
    """`omlx-jobs status`: a job_status() dict (jobs/progress.py) as lines."""
    rc, u, t, p = s["request_counts"], s["usage"], s["throughput"], s["prefix"]
    live = s.get("live") or {}
    lines = [
        f"job        {s['id']}",
        f"model      {s.get('model_name') or display_name(s['model'])}",
        f"status     {s['status']}",
        f"requests   {requests_line(rc, s['status'])}",
    ]
    if s["status"] not in lifecycle.TERMINAL and live:
        lines.append(
            f"now        prompt {live['prompt_tokens_per_second']:.1f} tok/s, generated "
            f"{live['generated_tokens_per_second']:.1f} tok/s, {live['requests_in_flight']} request(s) in flight"
            f" on {len(live['workers'])} worker(s)"
        )
    lines += [
        f"tokens     prompt {u['prompt_tokens']} (cached {u['prompt_tokens_details']['cached_tokens']}), "
        f"completion {u['completion_tokens']} (finished requests)",
        f"throughput {_rate(u, t)}, {t['requests_per_second']} req/s over {t['elapsed_seconds']}s (finished requests)",
    ]
    eta = _eta_line(s)
    if eta:
        lines.append(eta)
    lines += _prefix_lines(s, p, live)
    if s["errors"]:
        first = s["errors"][0]
        lines.append(f"errors     {len(s['errors'])} input error(s), first: line {first['line']}: {first['message']}")
    if s.get("priority", "normal") != "normal":
        lines.append(f"priority   {s['priority']}")
    for w in s.get("workers") or []:
        lines.append(f"worker     {w['worker']}: {w['completed']} completed, {w['failed']} failed")
    if s.get("live_workers") == 0 and s["status"] not in lifecycle.TERMINAL:
        lines.append(
            f"waiting    no live worker serves {s['queue']}: start one with `omlx-jobs worker --model {s['model']}`"
        )
    return lines


def _prefix_lines(s: dict[str, Any], p: dict[str, Any], live: dict[str, Any]) -> list[str]:
    if not p["trie_min_tokens"] and not live.get("prefilled_tokens"):
        return []
    if s["status"] not in lifecycle.TERMINAL:  # shards add their computed tokens when they end: count live
        computed = max(p["prefill_tokens_computed"], live.get("prefilled_tokens") or 0)
        return [f"prefix     computed {computed} prompt tokens so far; minimum {p['trie_min_tokens']} (planned)"]
    partial = ""
    if p.get("partial"):  # a killed or failed run never added its prefill: the figure undercounts
        partial = f" (partial: {p['unsettled_runs']} shard run(s) were killed or failed before counting theirs)"
    return [
        f"prefix     computed {p['prefill_tokens_computed']}{partial} / minimum {p['trie_min_tokens']} prompt tokens "
        f"= {p['efficiency']}x; cache hits {p['cache_hits']}, misses {p['cache_misses']}, "
        f"evictions {p['cache_evictions']}, peak {p['cache_peak_bytes'] / 1e6:.1f} MB"
    ]


def done_cell(counts: JobCounts, status: str) -> str:
    """The job list's DONE column: `64/65`, and for a job that ended short what became of the rest."""
    if status in ENDED_SHORT or counts.failed or counts.cancelled:
        parts = [f"{counts.completed}/{counts.total} ok"]
        parts += [f"{n} {what}" for n, what in ((counts.failed, "failed"), (counts.cancelled, "cancelled")) if n]
        return ", ".join(parts)
    return f"{counts.done}/{counts.total}"


def job_lines(rows: Iterable[tuple[JobInfo, JobCounts]]) -> list[str]:
    """`omlx-jobs jobs`: one line per job, newest first as given."""
    out = [f"{'JOB':34} {'STATUS':12} {'DONE':>28}  {'CREATED':19}  MODEL"]
    for job, counts in rows:
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(job.created_at))
        name = job.model_name or display_name(job.model)
        out.append(f"{job.id:34} {job.status:12} {done_cell(counts, job.status):>28}  {created}  {name}")
    return out


def worker_lines(workers: Iterable[WorkerInfo], now: float | None = None) -> list[str]:
    """`omlx-jobs workers`: one line per live worker with its current rates."""
    now = time.time() if now is None else now
    out = [
        f"{'WORKER':34} {'STATE':8} {'PROMPT/S':>9} {'GEN/S':>8} {'FLIGHT':>6} {'DONE':>8} {'BEAT':>5}  "
        f"{'JOB / SHARD':44} MODEL"
    ]
    for w in workers:
        running = f"{w.job_id} [{w.shard}]" if w.job_id else "-"
        beat = f"{max(0, now - w.last_heartbeat):.0f}s"
        out.append(
            f"{w.name:34} {w.state:8} {w.prompt_tokens_per_second:>9.1f} {w.tokens_per_second:>8.1f} "
            f"{w.in_flight:>6} {w.requests_done:>8} {beat:>5}  {running:44} {w.model_name}"
        )
    return out


def duration(seconds: float | None) -> str:
    """`45s`, `3m 20s`, `2h 5m`, `1d 3h`."""
    if seconds is None:
        return "-"
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60}s"
    if s < 86400:
        return f"{s // 3600}h {s % 3600 // 60}m"
    return f"{s // 86400}d {s % 86400 // 3600}h"


def print_rejection(load: Any) -> None:
    """A rejected file on stderr: the count, the first 50 errors, and what to do."""
    click.echo(f"rejected {load.job_id}: {load.invalid} bad line(s); nothing was queued.", err=True)
    for err in load.errors[:50]:
        click.echo(f"  {err}", err=True)
    if len(load.errors) > 50:
        click.echo(f"  ... and {load.invalid - 50} more (omlx-jobs status {load.job_id} --json)", err=True)
    click.echo("Fix the lines, or pass --skip-invalid to run the good ones.", err=True)


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
