"""Benchmark: a 100k-line batch through the HTTP API against the CLI, side by side in one run.

    .venv/bin/python bench/system/http_api.py                    # 100k lines, SQLite, Redis db 5
    .venv/bin/python bench/system/http_api.py --lines 20000 --repeat 2

(Not `http.py`: a script run from bench/system/ has that folder first on sys.path, so a bench/system/http.py
would stand in for the standard library's `http` package in every benchmark, and mlx-lm's imports would fail.)

HTTP path: the official openai client uploads the file to `omlx-jobs serve` (a separate process) and creates the
batch (validation and queueing happen in that call); the requests are then marked completed directly in the store
(bench/system/submit.py's `complete` phase, not timed: no 100k generations), and the client retrieves the batch and
streams the output and error files to disk. CLI path: `omlx-jobs submit`, the same marking, `omlx-jobs results`.
Reported: wall time of each step, the server's peak RSS (VmHWM of its process) and the CLI processes' peak RSS.
Goal (issue 13): the HTTP path within 1.5x the CLI's time, with the same bounded memory.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[2]))

from bench.lib.processes import measure, omlx_cli  # noqa: E402
from bench.system.submit import MODEL, write_input  # noqa: E402

KEY = "bench-key-" + uuid.uuid4().hex[:12]
TARGET_RATIO = 1.5


def _vm(pid: int, field: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


def _complete(db_url: str, job_id: str) -> dict[str, Any]:
    me = [sys.executable, str(HERE.parent / "submit.py"), "_phase"]
    return measure("  mark completed", [*me, "complete", db_url, job_id], checked=False).info


class Server:
    """`omlx-jobs serve` as a user runs it, on a free loopback port."""

    def __init__(self, work: Path, redis_url: str, lines: int) -> None:
        from tests.fault_harness import free_port

        self.port = free_port()
        self.db = work / "http.db"
        self.log = (work / "server.log").open("wb")
        cmd = [
            omlx_cli(), "serve", "--port", str(self.port), "--db", str(self.db), "--redis-url", redis_url,
            "--files-dir", str(work / "files"), "--api-key", KEY, "--model", f"any={MODEL}",
            "--max-upload-lines", str(max(lines * 2, 1000)), "--max-upload-bytes", "4GB",
        ]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=self.log)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 60
        import urllib.request

        while True:
            try:
                urllib.request.urlopen(f"{self.url}/healthz", timeout=2)
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError((work / "server.log").read_text()[-2000:]) from None
                time.sleep(0.1)
        self.started_rss = _vm(self.proc.pid, "VmRSS")

    def peak_rss(self) -> float:
        return _vm(self.proc.pid, "VmHWM")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def run_http(server: Server, input_path: Path, work: Path, run: int) -> dict[str, Any]:
    from openai import OpenAI

    client = OpenAI(base_url=f"{server.url}/v1", api_key=KEY, _strict_response_validation=True, timeout=600)
    t0 = time.perf_counter()
    with input_path.open("rb") as fh:
        f = client.files.create(file=fh, purpose="batch")
    t1 = time.perf_counter()
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    t2 = time.perf_counter()
    if batch.status != "in_progress":
        raise SystemExit(f"the batch is {batch.status}: {batch.errors}")
    marked = _complete(f"sqlite:///{server.db}", batch.id)
    t3 = time.perf_counter()
    while (batch := client.batches.retrieve(batch.id)).status != "completed":
        time.sleep(0.05)
    lines = 0
    for which, file_id in (("output", batch.output_file_id), ("errors", batch.error_file_id)):
        assert file_id is not None
        path = work / f"http-{which}-{run}.jsonl"
        with client.files.with_streaming_response.content(file_id) as response:
            response.stream_to_file(path)
        lines += sum(1 for _ in path.open("rb"))
    t4 = time.perf_counter()
    if lines != marked["completed"] + marked["failed"]:
        raise SystemExit(f"downloaded {lines} lines for {marked}")
    return {"upload": t1 - t0, "create": t2 - t1, "results": t4 - t3, "lines": lines, "job": batch.id}


def run_cli(input_path: Path, work: Path, redis_url: str, run: int) -> dict[str, Any]:
    db = work / f"cli-{run}.db"
    queue = f"omlx-bench-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "OMLX_JOBS_REDIS_URL": redis_url}
    py = [sys.executable, str(HERE.parent / "submit.py"), "_cli"]
    sub = measure(
        "cli submit", [*py, "submit", str(input_path), "--model", MODEL, "--queue", queue, "--db", str(db)], env
    )
    _drop_queue(redis_url, queue)
    job = sub.info["stdout"].strip()
    marked = _complete(f"sqlite:///{db}", job)
    out, err = work / f"cli-out-{run}.jsonl", work / f"cli-err-{run}.jsonl"
    res = measure("cli results", [*py, "results", job, "-o", str(out), "--errors", str(err), "--db", str(db)], env)
    lines = sum(1 for _ in out.open("rb")) + sum(1 for _ in err.open("rb"))
    if lines != marked["completed"] + marked["failed"]:
        raise SystemExit(f"cli results wrote {lines} lines for {marked}")
    return {"submit": sub.seconds, "results": res.seconds, "submit_rss": sub.rss_mb, "results_rss": res.rss_mb}


def _drop_queue(redis_url: str, queue: str) -> None:
    import redis
    from rq import Queue

    conn = redis.Redis.from_url(redis_url)
    Queue(queue, connection=conn).empty()
    conn.delete(f"rq:queue:{queue}")
    conn.srem("rq:queues", f"rq:queue:{queue}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lines", type=int, default=100_000)
    ap.add_argument("--repeat", type=int, default=1, help="interleaved runs (CLI, HTTP, CLI, HTTP...)")
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/5")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()
    load = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="omlx-bench-http-"))
    server = None
    try:
        input_path = work / "input.jsonl"
        size = write_input(input_path, args.lines)
        server = Server(work, args.redis_url, args.lines)
        runs = []
        for run in range(args.repeat):
            cli = run_cli(input_path, work, args.redis_url, run)
            http = run_http(server, input_path, work, run)
            _drop_queue(args.redis_url, f"omlx:{MODEL}")
            runs.append({"cli": cli, "http": http})
            print(f"run {run}: cli {json.dumps(cli)}\n       http {json.dumps(http)}", flush=True)
        peak = server.peak_rss()
        started = server.started_rss
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)

    best_cli = {k: min(r["cli"][k] for r in runs) for k in ("submit", "results")}
    best_http = {k: min(r["http"][k] for r in runs) for k in ("upload", "create", "results")}
    cli_rss = max(max(r["cli"]["submit_rss"], r["cli"]["results_rss"]) for r in runs)
    http_in = best_http["upload"] + best_http["create"]
    cli_total = best_cli["submit"] + best_cli["results"]
    http_total = http_in + best_http["results"]
    print(f"\n{args.lines:,} lines, {size / 1e6:.1f} MB; load average before: {', '.join(f'{x:.2f}' for x in load)}")
    if args.repeat > 1:
        print(f"best of {args.repeat} interleaved runs per step; peak RSS: the highest seen")
    print(f"{'step':<34} {'CLI s':>8} {'HTTP s':>8} {'HTTP/CLI':>9}")
    sub_ratio = http_in / best_cli["submit"]
    print(f"{'submit | upload + create':<34} {best_cli['submit']:>8.2f} {http_in:>8.2f} {sub_ratio:>8.2f}x")
    print(f"{'  (upload / create)':<34} {'':>8} {best_http['upload']:>4.2f}/{best_http['create']:.2f}")
    print(f"{'results | retrieve + 2 downloads':<34} {best_cli['results']:>8.2f} {best_http['results']:>8.2f} "
          f"{best_http['results'] / best_cli['results']:>8.2f}x")  # fmt: skip
    ratio = http_total / cli_total
    print(f"{'total':<34} {cli_total:>8.2f} {http_total:>8.2f} {ratio:>8.2f}x  (goal <= {TARGET_RATIO}x)")
    print(f"peak RSS: CLI processes {cli_rss:.1f} MB; server {peak:.1f} MB (at start {started:.1f} MB)")
    if args.json:
        figures = {"lines": args.lines, "bytes": size, "load": load, "runs": runs, "server_peak_rss_mb": peak,
                   "server_start_rss_mb": started, "cli_peak_rss_mb": cli_rss, "ratio": ratio}  # fmt: skip
        args.json.write_text(json.dumps(figures, indent=1))
    sys.exit(0 if ratio <= TARGET_RATIO else 1)


if __name__ == "__main__":
    main()
