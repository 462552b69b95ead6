"""Soak: one job through kill -9s at random points, a Redis restart and a SIGTERM drain; nothing may be lost.

Real parts only: a private redis-server (no persistence, so a restart loses every queued shard), a SQLite file,
worker processes (`omlx-jobs worker`) on the tiny test model or --model. The job is cut into shards so
several workers share it; after each kill a new worker starts at once. At the end every request must have
exactly one result, equal to an uninterrupted `omlx-jobs run` of the same file (greedy requests).

Prints requests, kills, lost, duplicated, wrong, recomputed per kill (requests started more than once:
attempts - 1, summed, over the kills) against the batch a worker holds in flight (--batch-size +
--prefill-batch-size), Redis restarts, drains and wall time. Exits 1 if anything was lost, duplicated or wrong.

    .venv/bin/python bench/system/soak.py                        # 20 kills, 1 Redis restart, 1 drain, tiny model
    .venv/bin/python bench/system/soak.py --pickup-trials 4      # also: how soon a dead worker's shard runs again
                                                          # with the default heartbeat TTL (45 s)
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import omlx_jobs.worker  # noqa: F401  (fast BLAS before mlx, for the reference run)
from tests.fault_harness import Cluster, RedisServer, invoke, outputs, shards_taken, write_greedy


@dataclass
class Soak:
    requests: int
    kills: int = 0
    kills_mid_shard: int = 0
    redis_restarts: int = 0
    drains: int = 0
    drain_exit_codes: list[int] = field(default_factory=list)
    lost: int = 0
    duplicated: int = 0
    wrong: int = 0
    recomputed: int = 0
    max_attempts: int = 0
    in_flight: int = 0
    wall_seconds: float = 0.0
    job_status: str = ""

    @property
    def recomputed_per_kill(self) -> float:
        return self.recomputed / self.kills if self.kills else 0.0


def busy(log: Path) -> bool:
    """Whether the worker writing `log` is inside a shard right now (its last shard line is a start)."""
    text = log.read_text(errors="replace")
    taken = text.rfind(": omlx-jobs shard ")
    return taken > max(text.rfind("Job OK"), text.rfind("exception raised while executing"))


def soak(args: argparse.Namespace, model: Path, workdir: Path) -> Soak:
    rng = random.Random(args.seed)
    src = write_greedy(workdir / "in.jsonl", args.requests, args.max_tokens)
    expected: dict[str, str | None] = {}
    if not args.no_reference:
        ref = {"OMLX_JOBS_DB": str(workdir / "reference.db"), "OMLX_JOBS_HOME": str(workdir / "home")}
        code, _, err = invoke(ref, "run", str(src), "--model", str(model), "-o", str(workdir / "reference.jsonl"))
        if code != 0:
            raise SystemExit(f"reference run failed: {err}")
        expected = outputs(workdir / "reference.db")

    worker_args = [
        "--batch-size",
        str(args.batch_size),
        "--prefill-batch-size",
        str(args.prefill_batch_size),
        "--heartbeat-ttl",
        str(args.ttl),
        "--drain-timeout",
        "30",
    ]
    result = Soak(requests=args.requests, in_flight=args.batch_size + args.prefill_batch_size)
    redis = RedisServer(workdir).start()
    cluster = Cluster(workdir, redis.url(), model, worker_args)
    started = time.monotonic()
    try:
        job = cluster.submit(src, "--shard-size", str(args.shard_size))
        alive = [cluster.start_worker(burst=False) for _ in range(args.workers)]
        logs = {p.pid: workdir / f"worker-{i}.log" for i, p in enumerate(cluster.workers)}
        events = ["kill"] * args.kills
        for _ in range(args.redis_restarts):
            events.insert(len(events) // 2, "redis")
        for _ in range(args.drains):
            events.insert(3 * len(events) // 4 + 1, "drain")
        last = 0
        for event in events:
            step = rng.randint(args.min_step, args.max_step)
            cluster.wait_until(f"progress before {event}", lambda s=step, n=last: cluster.completed(job) >= n + s, 300)
            if event != "redis":  # a kill or a drain hits a worker inside a shard
                cluster.wait_until("a busy worker", lambda: any(busy(logs[p.pid]) for p in alive), 300)
            time.sleep(rng.uniform(0, 0.3))
            last = cluster.completed(job)
            if last >= args.requests:
                raise SystemExit(f"the job finished before all events ran; raise --requests (done: {result})")
            if event == "redis":
                redis.kill()
                time.sleep(2)
                redis.start()
                result.redis_restarts += 1
            else:
                victim = rng.choice([p for p in alive if busy(logs[p.pid])] or alive)
                if event == "drain":
                    victim.send_signal(signal.SIGTERM)
                    result.drain_exit_codes.append(cluster.wait_worker(victim, timeout=90))
                    result.drains += 1
                else:
                    result.kills_mid_shard += busy(logs[victim.pid])
                    victim.send_signal(signal.SIGKILL)
                    victim.wait()
                    result.kills += 1
                alive.remove(victim)
                new = cluster.start_worker(burst=False)
                logs[new.pid] = workdir / f"worker-{len(cluster.workers) - 1}.log"
                alive.append(new)
            print(f"  {event:6} at {last:5d}/{args.requests} results, t={time.monotonic() - started:6.1f}s", flush=True)
        done = ("completed", "failed", "cancelled")
        cluster.wait_until("the job to finish", lambda: cluster.store.get_job(job).status in done, 600, poll=0.5)
        result.wall_seconds = time.monotonic() - started
        for proc in alive:
            proc.send_signal(signal.SIGTERM)
        for proc in alive:
            cluster.wait_worker(proc, timeout=60)
        count(cluster, job, expected, result)
    finally:
        cluster.close()
        redis.kill()
    return result


def count(cluster: Cluster, job: str, expected: dict[str, str | None], result: Soak) -> None:
    result.job_status = cluster.store.get_job(job).status
    rows = cluster.rows(job)
    result.lost = sum(r.status != "completed" for r in rows) + max(0, result.requests - len(rows))
    result.recomputed = sum(max(0, r.attempts - 1) for r in rows)
    result.max_attempts = max((r.attempts for r in rows), default=0)
    if expected:
        result.wrong = sum(r.status == "completed" and r.output_text != expected.get(r.custom_id) for r in rows)
    out = cluster.tmp / "results.jsonl"
    code, _, err = cluster.cli("results", job, "-o", str(out), "--force")
    if code != 0:
        raise SystemExit(f"results failed: {err}")
    ids = [json.loads(line)["custom_id"] for line in out.read_text().splitlines()]
    result.duplicated = len(ids) - len(set(ids)) + max(0, len(rows) - result.requests)


def measure_pickup(args: argparse.Namespace, model: Path, workdir: Path) -> list[float]:
    """Seconds from kill -9 of the worker running a shard to an idle worker starting it, at the default TTL."""
    workdir.mkdir()
    src = write_greedy(workdir / "in.jsonl", 1500, args.max_tokens)
    redis = RedisServer(workdir).start()
    worker_args = ["--batch-size", str(args.batch_size), "--prefill-batch-size", str(args.prefill_batch_size)]
    cluster = Cluster(workdir, redis.url(), model, worker_args)
    rng = random.Random(args.seed)
    seconds = []
    try:
        alive = [cluster.start_worker(burst=False) for _ in range(2)]
        logs = {p.pid: workdir / f"worker-{i}.log" for i, p in enumerate(cluster.workers)}
        cluster.wait_until("two idle workers", lambda: all("Listening on" in logs[p.pid].read_text() for p in alive))
        for trial in range(args.pickup_trials):
            # Random phases: of the idle worker's maintenance (every 30 s) and of the runner's heartbeat.
            time.sleep(rng.uniform(0, 30))
            job = cluster.submit(src)
            cluster.wait_until("the first result", lambda j=job: cluster.completed(j) >= 1, 120)
            (runner,) = [p for p in alive if job in logs[p.pid].read_text()]
            (idle,) = [p for p in alive if p is not runner]
            time.sleep(rng.uniform(0, 45 / 4))
            seen = len(shards_taken(logs[idle.pid]))
            runner.send_signal(signal.SIGKILL)
            runner.wait()
            killed = time.monotonic()
            again = lambda log=logs[idle.pid], n=seen: len(shards_taken(log)) > n  # noqa: E731
            cluster.wait_until("the shard to run again", again, 300, poll=0.1)
            seconds.append(time.monotonic() - killed)
            print(f"  pickup trial {trial + 1}: {seconds[-1]:.1f}s", flush=True)
            alive.remove(runner)
            new = cluster.start_worker(burst=False)
            logs[new.pid] = workdir / f"worker-{len(cluster.workers) - 1}.log"
            alive.append(new)
            cluster.wait_until("the job", lambda j=job: cluster.store.get_job(j).status == "completed", 300)
            cluster.wait_until("the new worker", lambda n=new: "Listening on" in logs[n.pid].read_text(), 120)
    finally:
        cluster.close()
        redis.kill()
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="tiny (the test model) or a model path / Hugging Face id")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--shard-size", type=int, default=100)
    ap.add_argument("--workers", type=int, default=2, help="workers running at once")
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--redis-restarts", type=int, default=1)
    ap.add_argument("--drains", type=int, default=1)
    ap.add_argument("--min-step", type=int, default=5, help="fewest new results between two events")
    ap.add_argument("--max-step", type=int, default=30, help="most new results between two events")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--prefill-batch-size", type=int, default=4)
    ap.add_argument("--ttl", type=int, default=4, help="workers' --heartbeat-ttl during the soak")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--no-reference", action="store_true", help="skip the uninterrupted run (slow models)")
    ap.add_argument("--pickup-trials", type=int, default=0, help="also measure pickup at the default TTL")
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs, database)")
    args = ap.parse_args()
    args.seed = args.seed if args.seed is not None else random.randrange(1 << 30)

    workdir = Path(tempfile.mkdtemp(prefix="omlx-soak-"))
    model = Path(args.model)
    if args.model == "tiny":
        from tests.tiny_model import build_tiny_model

        model = build_tiny_model(workdir / "tiny-model")
    print(f"soak: seed {args.seed}, work dir {workdir}; {platform.machine()} {platform.system()}", flush=True)
    result = soak(args, model, workdir)
    pickup = measure_pickup(args, model, workdir / "pickup") if args.pickup_trials else []

    rows = [
        ("requests", result.requests, ""),
        ("kills (SIGKILL)", result.kills, f"{result.kills_mid_shard} inside a shard"),
        ("lost", result.lost, "target 0"),
        ("duplicated", result.duplicated, "target 0"),
        ("wrong (vs uninterrupted run)", "-" if args.no_reference else result.wrong, "target 0"),
        ("recomputed (attempts - 1)", result.recomputed, f"max attempts of a request {result.max_attempts}"),
        ("recomputed per kill", f"{result.recomputed_per_kill:.2f}", f"batch in flight {result.in_flight}"),
        ("Redis restarts", result.redis_restarts, "no persistence: every queued shard lost"),
        ("drains (SIGTERM)", result.drains, f"exit codes {result.drain_exit_codes}"),
        ("wall time", f"{result.wall_seconds:.1f}s", f"job {result.job_status}"),
    ]
    if pickup:
        rows.append(("pickup after kill, TTL 45", f"max {max(pickup):.1f}s", " ".join(f"{s:.1f}" for s in pickup)))
    print()
    for name, value, note in rows:
        print(f"{name:30} {value!s:>10}  {note}")
    if args.json:
        args.json.write_text(json.dumps({**asdict(result), "argv": sys.argv, "pickup_seconds": pickup}, indent=1))
    if not args.keep:
        subprocess.run(["rm", "-rf", str(workdir)], check=False)
    bad = result.lost or result.duplicated or result.wrong or any(result.drain_exit_codes)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
