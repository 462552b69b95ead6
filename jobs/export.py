"""Write a job's results as OpenAI batch output JSONL, streamed from the store in input order.

Where they go (`results -o`, `run -o`):
- `-` or nothing: stdout.
- a new path: a file, written beside its final name and renamed into place, so no reader sees half of it.
- an existing regular file: replaced the same way, only with --force.
- a device, FIFO or socket (/dev/stdout, a named pipe, /dev/full): written through, never replaced.
- a symbolic link to a file: refused without --force (its target would change silently); with --force the
  results are written through it into the target, and the link stays a link.
The output and the errors may not be one and the same file.
"""

from __future__ import annotations

import contextlib
import os
import stat
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


class OutputError(OmlxError, ValueError):
    """An output path that cannot or may not be written; the message says why and what to do."""


class OutputExists(OutputError, FileExistsError):
    """An output file exists and --force was not given."""


class StdoutClosed(OutputError):
    """stdout went away (a pipe reader like `head` exited): not an error worth a message."""


@dataclass(frozen=True)
class Destination:
    """Where one stream of lines goes. kind: stdout, file (temp + rename onto `path`) or stream (open as is)."""

    kind: str
    path: Path | None = None
    shown: str = "stdout"


STDOUT = Destination("stdout")


def destination(path: Path | str | None, *, force: bool = False, what: str = "output") -> Destination:
    """Decide how to write `path` (see the module docstring); raise OutputError if it must not be written."""
    if path is None or str(path) == "-":
        return STDOUT
    path = Path(path)
    shown = str(path)
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        _check_parent(path, what)
        return Destination("file", path, shown)
    except OSError as exc:
        raise OutputError(f"cannot write the {what} to {shown}: {exc.strerror or exc}") from None
    if stat.S_ISLNK(st.st_mode):
        return _through_link(path, force, what)
    if stat.S_ISDIR(st.st_mode):
        raise OutputError(f"cannot write the {what} to {shown}: it is a folder; give a file name")
    if stat.S_ISREG(st.st_mode):
        if not force:
            raise OutputExists(f"{shown} exists; pass --force to overwrite it")
        return Destination("file", path, shown)
    return Destination("stream", path, shown)  # a device, FIFO or socket: write through it


def _through_link(path: Path, force: bool, what: str) -> Destination:
    target = Path(os.path.realpath(path))
    try:
        st = os.stat(path)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise OutputError(f"cannot write the {what} to {path}: {exc.strerror or exc}") from None
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise OutputError(f"cannot write the {what} to {path}: it links to the folder {target}; give a file name")
    if st is not None and not stat.S_ISREG(st.st_mode):
        return Destination("stream", path, str(path))  # e.g. /dev/stdout: written through, as a shell would
    if not force:
        raise OutputExists(
            f"{path} is a symbolic link to {target}; pass --force to write the {what} through it into {target} "
            "(the link stays)"
        )
    _check_parent(target, what)
    return Destination("file", target, f"{path} (-> {target})")


def _check_parent(path: Path, what: str) -> None:
    """A clear error when the file's folder cannot be there; missing folders are created at write time."""
    for parent in (path.parent, *path.parent.parents):
        if parent.exists():
            if not parent.is_dir():
                raise OutputError(f"cannot write the {what} to {path}: {parent} is a file, not a folder")
            return


def check_distinct(output: Destination, errors: Destination | None) -> None:
    """Refuse one file for both the output and the errors: the second would overwrite the first."""
    if errors is None:
        return
    if output.kind == errors.kind == "stdout":
        raise OutputError("--output and --errors are both stdout; give --errors a file, or leave it out")
    if output.path is None or errors.path is None:
        return
    same = os.path.realpath(output.path) == os.path.realpath(errors.path)
    if not same and output.path.exists() and errors.path.exists():
        same = os.path.samefile(output.path, errors.path)
    if same:
        raise OutputError(f"--output and --errors name the same file ({output.shown}); give them different paths")


class _Sink:
    """An open destination: write lines, then commit (rename a temp file into place) or abort."""

    def __init__(self, dest: Destination) -> None:
        self.dest = dest
        self.tmp: str | None = None
        try:
            if dest.kind == "stdout":
                self.fh: IO[str] = sys.stdout
            elif dest.kind == "stream":
                self.fh = open(dest.path, "w", encoding="utf-8")  # noqa: SIM115
            else:
                assert dest.path is not None
                dest.path.parent.mkdir(parents=True, exist_ok=True)
                fd, self.tmp = tempfile.mkstemp(dir=dest.path.parent, prefix=f".{dest.path.name}.", suffix=".part")
                self.fh = os.fdopen(fd, "w", encoding="utf-8")
        except OSError as exc:
            raise self.error(exc) from None

    def write(self, line: str) -> None:
        try:
            self.fh.write(line)
        except OSError as exc:
            raise self.error(exc) from None

    def error(self, exc: OSError) -> OutputError:
        if self.dest.kind == "stdout" and isinstance(exc, BrokenPipeError):
            return StdoutClosed("stdout was closed")
        return OutputError(f"cannot write {self.dest.shown}: {exc.strerror or exc}")

    def commit(self) -> None:
        try:
            self.fh.flush()
            if self.fh is not sys.stdout:
                self.fh.close()
            if self.tmp is not None and self.dest.path is not None:
                os.replace(self.tmp, self.dest.path)
                self.tmp = None
        except OSError as exc:
            raise self.error(exc) from None
        finally:
            self.abort()

    def abort(self) -> None:
        if self.fh is not sys.stdout:
            with contextlib.suppress(OSError):
                self.fh.close()
        if self.tmp is not None:
            Path(self.tmp).unlink(missing_ok=True)
            self.tmp = None


def write_results(
    store: Store,
    job_id: str,
    output: Path | str | None = None,
    errors: Path | str | None = None,
    *,
    force: bool = False,
) -> ExportCounts:
    """Write result lines to `output` (stdout if None or "-") and error lines to `errors` (or into `output`).

    Raises OutputError (OutputExists, StdoutClosed) with a message that says what to do.
    """
    out_dest = destination(output, force=force, what="output")
    err_dest = destination(errors, force=force, what="errors") if errors is not None else None
    check_distinct(out_dest, err_dest)
    job = store.get_job(job_id)
    models = store.run_models(job_id)
    counts = ExportCounts(pending=store.counts(job_id).pending)
    sinks = [_Sink(out_dest)]
    try:
        if err_dest is not None:
            sinks.append(_Sink(err_dest))
        out_sink, err_sink = sinks[0], sinks[-1]
        rows = store.iter_requests(job_id, columns=OUTPUT_COLUMNS)
        for line, is_error in output_lines(rows, job_id, job.model, models):
            if is_error:
                err_sink.write(line + "\n")
                counts.errors += 1
            else:
                out_sink.write(line + "\n")
                counts.written += 1
        for sink in sinks:
            sink.commit()
    finally:
        for sink in sinks:
            sink.abort()  # after a commit there is nothing left to abort
    return counts
