"""Benchmark two commits side by side: the same bench/engine/prefix.py workload, old and new alternately, one run.

The old commit is checked out into a temporary git worktree; each side runs its own bench/engine/prefix.py in a
subprocess whose import path resolves `omlx_jobs` (and `bench`, `tests`) to that side's tree, so the two never
mix. Runs alternate, in the order old new, new old, old new, ... so that a busy machine slows both alike and
neither always goes first. The report gives, per workload and configuration: the median wall time of each
side and their ratio new / old; the ratio of each side's best run (the one a busy machine disturbed least);
the per-round ratios; whether both computed the same number of prompt tokens (the same plan). It also gives
each side's median CPU time per process (user + system, model loading included).

    .venv/bin/python bench/decisions/compare_commits.py --old c5f3277 --rounds 3 -- --quick --runs off
    .venv/bin/python bench/decisions/compare_commits.py --old c5f3277 --rounds 2 -- \\
        --model gguf:$(.venv/bin/omlx-jobs models smollm2-path) --scale 0.125 --runs off
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parents[2]


def git(*args: str, cwd: Path = HERE) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def side_env(root: Path, site: Path) -> dict[str, str]:
    """An environment whose `import omlx_jobs` is `root` (a symlink named omlx_jobs, first on the path)."""
    site.mkdir(parents=True, exist_ok=True)
    link = site / "omlx_jobs"
    if not link.exists():
        link.symlink_to(root, target_is_directory=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(root)])
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def check_imports(root: Path, env: dict[str, str]) -> None:
    code = "import omlx_jobs, bench, tests; print(omlx_jobs.__file__, bench.__file__, tests.__path__[0])"
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, check=True, capture_output=True, text=True)
    for path in out.stdout.split():
        if not Path(path).resolve().is_relative_to(root.resolve()):
            raise SystemExit(f"{root}: imports resolve to {path}, not to this tree")


def run_side(root: Path, env: dict[str, str], bench_args: list[str], out_json: Path, log: Any) -> dict[str, Any]:
    # bench/engine/prefix.py since the benchmarks live in topic folders; an older commit has bench/prefix.py.
    script = next(p for p in (root / "bench" / "engine" / "prefix.py", root / "bench" / "prefix.py") if p.exists())
    cmd = [sys.executable, str(script), *bench_args, "--json", str(out_json)]
    tic, before = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    wall = time.perf_counter() - tic
    log.write(f"\n===== {root} (wall {wall:.1f}s, cpu {cpu:.1f}s): {' '.join(cmd)}\n{proc.stdout}{proc.stderr}")
    log.flush()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed (see the log):\n{proc.stderr[-2000:]}")
    return {**json.loads(out_json.read_text()), "process_cpu_seconds": round(cpu, 2)}


def figures(result: dict[str, Any]) -> dict[tuple[str, str], tuple[float, int]]:
    """(workload, run label) -> (wall seconds, prefill tokens computed), for omlx-jobs runs only."""
    out = {}
    for w in result["results"]:
        for r in w["runs"]:
            if r["label"].startswith("omlx-jobs"):
                out[(w["workload"], r["label"])] = (r["seconds"], r["prefill_tokens"])
    return out


def report(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    print(f"\n{'workload':9} {'run':28} {'old s':>8} {'new s':>8} {'new/old':>8} {'best':>6}  per-round new/old")
    for key in sorted(figures(old[0])):
        o = [figures(r)[key] for r in old]
        n = [figures(r)[key] for r in new]
        same_plan = len({t for _, t in o} | {t for _, t in n}) == 1
        per_round = [round(b[0] / a[0], 3) for a, b in zip(o, n, strict=True)]
        med_o, med_n = statistics.median(s for s, _ in o), statistics.median(s for s, _ in n)
        row = {
            "workload": key[0],
            "run": key[1],
            "old_seconds": [s for s, _ in o],
            "new_seconds": [s for s, _ in n],
            "ratio_new_over_old": round(med_n / med_o, 3),
            "per_round": per_round,
            "same_prefill_tokens": same_plan,
        }
        rows.append(row)
        # The best run of each side is the one a busy machine disturbed least.
        best = min(s for s, _ in n) / min(s for s, _ in o)
        row["ratio_best_new_over_best_old"] = round(best, 3)
        flag = "" if same_plan else "  PREFILL TOKENS DIFFER"
        print(f"{key[0]:9} {key[1]:28} {med_o:8.2f} {med_n:8.2f} {med_n / med_o:8.3f} {best:6.3f}  {per_round}{flag}")
    total_o = sum(statistics.median(figures(r)[k][0] for r in old) for k in figures(old[0]))
    total_n = sum(statistics.median(figures(r)[k][0] for r in new) for k in figures(old[0]))
    print(f"{'all':9} {'(sum of medians)':28} {total_o:8.2f} {total_n:8.2f} {total_n / total_o:8.3f}")
    cpu_o = [r["process_cpu_seconds"] for r in old]
    cpu_n = [r["process_cpu_seconds"] for r in new]
    med_o, med_n = statistics.median(cpu_o), statistics.median(cpu_n)
    cpu_ratio = med_n / med_o
    print(f"{'process':9} {'cpu s (median)':28} {med_o:8.2f} {med_n:8.2f} {cpu_ratio:8.3f}")
    rows.append(
        {
            "workload": "all",
            "run": "process cpu seconds",
            "old_seconds": cpu_o,
            "new_seconds": cpu_n,
            "ratio_new_over_old": round(cpu_ratio, 3),
        }
    )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", default="c5f3277", help="the commit to compare against")
    ap.add_argument("--new", default=None, help="a commit for the new side (default: this checkout as it is)")
    ap.add_argument("--rounds", type=int, default=3, help="old/new pairs to run")
    ap.add_argument("--log", type=Path, help="append every run's output here")
    ap.add_argument("--json", type=Path, help="write the comparison here")
    ap.add_argument("bench_args", nargs=argparse.REMAINDER, help="after --: bench/engine/prefix.py's arguments")
    args = ap.parse_args()
    bench_args = [a for a in args.bench_args if a != "--"]
    with tempfile.TemporaryDirectory(prefix="omlx-compare-") as tmp:
        tmp_path = Path(tmp)
        roots = {}
        for side, rev in (("old", args.old), ("new", args.new)):
            if rev is None:
                roots[side] = HERE
            else:
                roots[side] = tmp_path / side
                git("worktree", "add", "--detach", str(roots[side]), rev)
        try:
            envs = {side: side_env(root, tmp_path / f"site-{side}") for side, root in roots.items()}
            for side in roots:
                check_imports(roots[side], envs[side])
            results: dict[str, list[dict[str, Any]]] = {"old": [], "new": []}
            log = open(args.log, "a") if args.log else open(os.devnull, "w")  # noqa: SIM115
            with log:
                log.write(f"\n##### {time.strftime('%Y-%m-%d %H:%M:%S')} old={args.old} new={args.new or HERE}\n")
                for i in range(args.rounds):
                    for side in ("old", "new") if i % 2 == 0 else ("new", "old"):
                        print(f"round {i + 1}/{args.rounds}: {side} ...", file=sys.stderr, flush=True)
                        out = tmp_path / f"{side}-{i}.json"
                        results[side].append(run_side(roots[side], envs[side], bench_args, out, log))
            rows = report(results["old"], results["new"])
        finally:
            for root in roots.values():
                if root != HERE:
                    git("worktree", "remove", "--force", str(root))
    if args.json:
        old_rev = git("rev-parse", "--short", args.old)
        new_rev = git("rev-parse", "--short", args.new) if args.new else git("rev-parse", "--short", "HEAD")
        args.json.write_text(
            json.dumps(
                {
                    "date": time.strftime("%Y-%m-%d"),
                    "old": old_rev,
                    "new": new_rev if args.new else f"{new_rev} (working tree)",
                    "bench_args": bench_args,
                    "rounds": args.rounds,
                    "comparison": rows,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
