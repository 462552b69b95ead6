"""Write a job's results as OpenAI batch output JSONL, streamed from the store in input order."""

from __future__ import annotations

import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from omlx_jobs.errors import OmlxError
from omlx_jobs.jobs.output import OUTPUT_COLUMNS, output_lines
from omlx_jobs.store import Store


@dataclass
class ExportCounts:
    written: int = 0
    errors: int = 0
    pending: int = 0


class OutputExists(OmlxError, FileExistsError):
    """An output file exists and --force was not given."""


def _open_atomic(path: Path) -> tuple[IO[str], str]:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
    return os.fdopen(fd, "w", encoding="utf-8"), tmp


def write_results(
    store: Store,
    job_id: str,
    output: Path | None = None,
    errors: Path | None = None,
    *,
    force: bool = False,
) -> ExportCounts:
    """Write result lines to `output` (stdout if None) and error lines to `errors` (or into `output`).

    Files are written beside their target and renamed into place, so a reader never sees half a file.
    An existing file is only replaced with `force`.
    """
    for path in (output, errors):
        if path is not None and path.exists() and not force:
            raise OutputExists(f"{path} exists; pass --force to overwrite it")
    job = store.get_job(job_id)
    counts = ExportCounts()
    targets: list[tuple[IO[str], str | None, Path | None]] = []
    out_fh: IO[str]
    if output is None:
        out_fh = sys.stdout
    else:
        output.parent.mkdir(parents=True, exist_ok=True)
        out_fh, tmp = _open_atomic(output)
        targets.append((out_fh, tmp, output))
    err_fh = out_fh
    if errors is not None:
        errors.parent.mkdir(parents=True, exist_ok=True)
        err_fh, tmp = _open_atomic(errors)
        targets.append((err_fh, tmp, errors))
    ok = False
    try:
        counts.pending = store.counts(job_id).pending
        for line, is_error in output_lines(store.iter_requests(job_id, columns=OUTPUT_COLUMNS), job_id, job.model):
            (err_fh if is_error else out_fh).write(line + "\n")
            if is_error:
                counts.errors += 1
            else:
                counts.written += 1
        ok = True
    finally:
        for fh, tmp, final in targets:
            fh.close()
            if tmp is None or final is None:
                continue
            if ok:
                os.replace(tmp, final)
            else:
                Path(tmp).unlink(missing_ok=True)
    return counts
