"""Benchmark child processes: run one and measure it (wall, CPU, its own peak RSS), and what a child reports."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

PEAK_MARKER = "bench-peak-rss: "
"""A child prints this, then JSON with its peak_rss_mb, on stderr (see `measure`)."""


def abort(message: str) -> NoReturn:
    """The benchmark cannot go on: the message on stderr, exit code 2."""
    print(message, file=sys.stderr)
    raise SystemExit(2)


def peak_rss_mb() -> float:
    """This process's own peak RSS. Not the parent's view of ru_maxrss: Linux carries the forking parent's
    high-water mark across exec, so a child would never report less than the benchmark driver itself."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 1024**2 if sys.platform == "darwin" else peak / 1024


def mlx_modules(names: Iterable[str]) -> list[str]:
    """The MLX modules among `names` (the client path must import none)."""
    return sorted(m for m in names if m == "mlx" or m.startswith(("mlx.", "mlx_lm")))


@dataclass
class Measured:
    """One child process: its wall and CPU seconds, its own peak RSS, and the JSON it printed last."""

    name: str
    seconds: float
    cpu_seconds: float
    rss_mb: float
    info: dict[str, Any]
    checked: bool = True  # compared against the benchmark's targets


def measure(name: str, cmd: list[str], env: dict[str, str] | None = None, *, checked: bool = True) -> Measured:
    """Run `cmd`; wall and CPU time of the whole process (interpreter start included) and its own peak RSS."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    # wait4: this child's own CPU time, not the sum over every child so far.
    out_text = proc.stdout.read() if proc.stdout else ""
    err_text = proc.stderr.read() if proc.stderr else ""
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        tail = "\n".join(err_text.strip().splitlines()[-15:])
        abort(f"phase {name} failed (exit {proc.returncode}):\n{tail}")
    last = out_text.strip().splitlines()[-1] if out_text.strip() else ""
    try:
        info = json.loads(last)
    except json.JSONDecodeError:
        info = {"stdout": last}
    for ln in err_text.splitlines():
        if ln.startswith(PEAK_MARKER):
            info.update(json.loads(ln[len(PEAK_MARKER) :]))
    # `python -X importtime` writes every import to stderr: how the CLI phases prove mlx stays out.
    imported = {ln.rsplit("|", 1)[-1].strip() for ln in err_text.splitlines() if ln.startswith("import time:")}
    info["mlx_imported"] = sorted({*info.get("mlx_imported", []), *mlx_modules(imported)})
    return Measured(name, seconds, usage.ru_utime + usage.ru_stime, info["peak_rss_mb"], info, checked)


def omlx_cli() -> str:
    """The installed `omlx-jobs` script beside this interpreter."""
    exe = Path(sys.executable).with_name("omlx-jobs")
    if not exe.exists():
        abort(f"{exe} not found: install the package (pip install -e .) in this venv")
    return str(exe)
