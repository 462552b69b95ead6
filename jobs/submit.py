"""Submit: stream a JSONL file into the store (validated), then hand shards to the queue."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from queue import Queue
from typing import IO, Any

from omlx_jobs import defaults
from omlx_jobs.errors import ErrorCode, OmlxError
from omlx_jobs.jobs import lifecycle
from omlx_jobs.jobs.embeddings import dimensions_refusal, is_embeddings, refuse_dimensions
from omlx_jobs.jobs.formats import NO_FILES, InputError, ParsedRequest, parse_stream
from omlx_jobs.jobs.images import ImageAccess
from omlx_jobs.jobs.lease import SubmitLease
from omlx_jobs.jobs.model_names import display_name
from omlx_jobs.jobs.sharding import DEFAULT_SHARD_SIZE, cut_shards, request_key
from omlx_jobs.store import RequestStatus, Store
from omlx_jobs.store.shards import END_KEY, ShardCut

MAX_REPORTED_ERRORS = 1000
INSERT_CHUNK = 2000


@dataclass
class LoadResult:
    job_id: str
    total: int = 0
    valid: int = 0
    invalid: int = 0
    errors: list[InputError] = field(default_factory=list)
    rejected: bool = False

    @property
    def summary(self) -> str:
        if self.rejected:
            return f"rejected: {self.invalid} bad line(s), nothing was queued"
        skipped = f", {self.invalid} invalid line(s) recorded as failed" if self.invalid else ""
        return f"{self.valid} request(s){skipped}"


class BadSubmit(OmlxError, ValueError):
    """An argument of submit itself (not a line) that cannot work; the message says which and what to do."""


MAX_MODEL_CHARS = 1024  # the jobs.model column


def check_model(model: str) -> str:
    """The --model string a job runs on, refused if empty, blank, over 1,024 characters or holding control chars."""
    if not model or not model.strip():
        raise BadSubmit("--model is empty; give the model the workers serve (the same string as `worker --model`)")
    if len(model) > MAX_MODEL_CHARS:
        raise BadSubmit(f"--model is {len(model):,} characters; at most {MAX_MODEL_CHARS:,} are allowed")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in model):
        raise BadSubmit("--model holds a control character (a newline, a NUL, ...); give the model's name or path")
    return model


class _ChunkWriter:
    """Stores chunks of rows in order. For a database server it does so on a second thread, so parsing the next
    chunk overlaps the server's work on this one (PostgreSQL spends about as long on a COPY as we spend parsing
    its lines). SQLite writes inline: its work is ours too, and an in-memory database is per thread.

    At most `depth` chunks wait, so memory stays bounded. A failed insert surfaces at the next `put` or at
    `check`; the chunks after it are dropped.
    """

    def __init__(self, store: Store, depth: int = 2) -> None:
        self._store = store
        self._error: BaseException | None = None
        self._chunks: Queue[list[dict[str, Any]] | None] = Queue(maxsize=depth)
        self._thread: threading.Thread | None = None
        if not store.is_sqlite:
            self._thread = threading.Thread(target=self._run, name="omlx-submit-writer", daemon=True)
            self._thread.start()

    def put(self, rows: list[dict[str, Any]]) -> None:
        self.check()
        if self._thread is None:
            self._store.add_requests(rows)
        else:
            self._chunks.put(rows)

    def close(self) -> None:
        """Wait until every chunk handed over is stored (or dropped after an error). Never raises."""
        if self._thread is not None:
            self._chunks.put(None)
            self._thread.join()

    def check(self) -> None:
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        while (rows := self._chunks.get()) is not None:
            if self._error is not None:
                continue  # keep draining, so `put` never blocks on a dead writer
            try:
                self._store.add_requests(rows)
            except BaseException as exc:
                self._error = exc


def load_job(
    store: Store,
    source: Path | IO[bytes],
    model: str,
    *,
    skip_invalid: bool = False,
    queue: str | None = None,
    job_id: str | None = None,
    shard_size: int | None = None,
    options: dict[str, Any] | None = None,
    on_progress: Callable[[int], None] | None = None,
    images: ImageAccess = NO_FILES,
    lease_seconds: float = defaults.SUBMIT_LEASE,
    model_name: str | None = None,
) -> LoadResult:
    """Create a job and its request rows from a JSONL stream, in prefix order, cut into shards; never holds
    the whole file in memory (the database sorts the keys).

    `images` says where images in messages may come from (data: URIs only by default); `model_name` is the
    model's short name (default: derived from `model`, jobs/model_names.py).

    With bad lines and no `skip_invalid`, the job is marked failed with the errors and keeps no requests.
    If loading stops midway (Ctrl-C, a signal, an error), the job is removed again: none is left half-made.
    While it loads, the job holds a lease it renews (jobs/lease.py): a kill -9 leaves a job that reconcile fails.
    """
    check_model(model)
    job_id = job_id or lifecycle.new_job_id()
    name = str(Path(source).resolve()) if isinstance(source, Path) else getattr(source, "name", None)
    # Opened before the job exists: opening a FIFO blocks until a writer comes, and Ctrl-C may come first.
    stream = open(source, "rb") if isinstance(source, Path) else source  # noqa: SIM115
    try:
        opts = {"skip_invalid": skip_invalid, **(options or {})}
        lease = SubmitLease(store, job_id, lease_seconds)
        short = display_name(model, model_name)
        store.create_job(
            job_id,
            model,
            queue=queue,
            input_file=name,
            options=opts,
            model_name=short,
            submit_lease_until=lease.first_until(),
        )
        try:
            no_dims = dimensions_refusal(model)  # a local embedding model without Matryoshka: known right here
            result = _load_rows(store, stream, job_id, skip_invalid, on_progress, images, lease, no_dims)
            if not result.rejected:
                cut_job(store, job_id, shard_size or DEFAULT_SHARD_SIZE, lease=lease)
                store.update_job(job_id, errors=[e.to_dict() for e in result.errors] or None)
                lease.release(result.total)
        except BaseException:
            with contextlib.suppress(Exception):  # the store may be what failed; the original error matters
                store.delete_job(job_id)
            raise
    finally:
        if stream is not source:
            stream.close()
    return result


def cut_job(store: Store, job_id: str, shard_size: int, *, lease: SubmitLease | None = None) -> int:
    """Cut the job's pending requests, in prefix order, into shards and store them; returns how many.

    The keys stream from an index scan; only the keys of the open shard's window are held (to name bounds).
    """
    window: dict[int, tuple[bytes, int]] = {}  # position -> (sort_key, idx), for positions not cut yet

    def keys() -> Iterator[bytes]:
        for pos, (key, idx) in enumerate(store.iter_pending_keys(job_id)):
            window[pos] = (key, idx)
            if lease is not None:
                lease.renew_if_due()
            yield key

    cuts: list[ShardCut] = []
    for c in cut_shards(keys(), shard_size):
        first_key, first_idx = window[c.first]
        if cuts:  # the previous shard ends where this one starts
            cuts[-1] = dataclasses.replace(cuts[-1], end_key=first_key, end_idx=first_idx)
        cuts.append(
            ShardCut(
                c.first, c.end, first_key, first_idx, END_KEY, 0, c.group_first, c.group_last, c.lead_rows, c.tail_rows
            )
        )
        for pos in range(c.first, c.end):
            window.pop(pos, None)
    store.add_shards(job_id, cuts)
    return len(cuts)


def _load_rows(
    store: Store,
    stream: IO[bytes],
    job_id: str,
    skip_invalid: bool,
    on_progress: Callable[[int], None] | None,
    images: ImageAccess,
    lease: SubmitLease,
    no_dimensions: str | None = None,
) -> LoadResult:
    result = LoadResult(job_id)
    rows: list[dict[str, Any]] = []
    writer = _ChunkWriter(store)

    def flush() -> None:
        nonlocal rows
        if rows:
            writer.put(rows)
            rows = []
        if on_progress:
            on_progress(result.total)

    try:
        for parsed in parse_stream(stream, images):
            lease.renew_if_due()
            item = parsed
            if no_dimensions is not None and not isinstance(parsed, InputError) and is_embeddings(parsed.endpoint):
                item = refuse_dimensions(parsed.line, parsed.custom_id, parsed.body, no_dimensions) or parsed
            if isinstance(item, InputError):
                result.invalid += 1
                if len(result.errors) < MAX_REPORTED_ERRORS:
                    result.errors.append(item)
                if not skip_invalid:
                    continue
                rows.append(_failed_row(job_id, result.total, item))
            else:
                result.valid += 1
                if result.invalid and not skip_invalid:
                    continue  # the file is rejected anyway; keep validating, stop storing
                rows.append(_pending_row(job_id, result.total, item))
            result.total += 1
            if len(rows) >= INSERT_CHUNK:
                flush()
        flush()
    finally:
        writer.close()
    writer.check()

    _reject_if_invalid(store, result, skip_invalid)
    return result


def _reject_if_invalid(store: Store, result: LoadResult, skip_invalid: bool) -> None:
    """Fail the job, storing no request, if the file holds none or a bad line that `skip_invalid` does not allow."""
    if result.valid + result.invalid == 0:
        result.errors.append(InputError(0, "the file holds no requests", code=ErrorCode.EMPTY_FILE))
        result.invalid = 1
    if (result.invalid and not skip_invalid) or result.valid == 0:
        result.rejected = True
        store.delete_requests(result.job_id)
        store.update_job(result.job_id, total=0, errors=[e.to_dict() for e in result.errors], submit_lease_until=None)
        store.transition(result.job_id, lifecycle.FAILED)
        result.total = 0


def _pending_row(job_id: str, idx: int, item: ParsedRequest) -> dict[str, Any]:
    return {
        "job_id": job_id,
        "idx": idx,
        "line": item.line,
        "custom_id": item.custom_id,
        "endpoint": item.endpoint,
        "body": item.body,
        "status": RequestStatus.PENDING,
        "sort_key": request_key(item.endpoint, item.body),
    }


def _failed_row(job_id: str, idx: int, error: InputError) -> dict[str, Any]:
    import time

    return {
        "job_id": job_id,
        "idx": idx,
        "line": error.line,
        "custom_id": error.custom_id if error.custom_id is not None else f"line-{error.line}",
        "endpoint": "",
        "body": None,
        "status": RequestStatus.FAILED,
        "error_code": error.code.value,
        "error_message": str(error),
        "finished_at": time.time(),
    }
