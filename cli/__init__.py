"""The omlx-jobs command line: click only. Each command parses its options, calls functions of jobs/, store/,
api/ or (for `worker`, `run` and `models`, lazily) worker/, and renders what they return.

`omlx_jobs.cli:main` is the console script; `python -m omlx_jobs.cli` runs the same.
"""

from __future__ import annotations

from omlx_jobs.cli.app import cli, main

__all__ = ["cli", "main"]
