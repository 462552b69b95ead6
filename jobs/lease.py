"""The submit lease: how a submit that died (kill -9, a lost machine) is told from one that is still storing.

While `submit` (or `serve`'s batch create, or `run`) stores a file, its job is `validating` and holds a lease,
a time in the job row that the submit pushes forward every quarter of its length. A validating job whose lease
has passed lost its submit: reconcile (on any worker of its queue) and `resume` fail it and drop what was stored.
A submit whose job was failed that way stops at its next renewal (SubmitLost), so it never queues a dead job.
Once the file is stored whole, the lease is cleared: a job left validating then (Redis failed before its shards
were queued) is `resume`d as before.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from omlx_jobs import defaults
from omlx_jobs.errors import ErrorCode, OmlxError
from omlx_jobs.store import Store

INTERRUPTED_MESSAGE = (
    "the submit stopped before the whole file was stored (it was killed, or lost its machine or the store); "
    "nothing was queued. Submit the file again"
)


class SubmitLost(OmlxError, RuntimeError):
    """The job's lease passed while this submit was stalled, and the job was failed meanwhile."""


class SubmitLease:
    """A submit's hold on its job: `renew_if_due` is cheap (a clock read) and renews every quarter lease."""

    def __init__(
        self,
        store: Store,
        job_id: str,
        seconds: float = defaults.SUBMIT_LEASE,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if seconds <= 0:
            raise ValueError("the submit lease must be positive")
        self.store, self.job_id, self.seconds, self.clock = store, job_id, seconds, clock
        self._due = time.monotonic() + seconds / 4

    def first_until(self) -> float:
        """The lease a new job starts with (the job is created holding it)."""
        return self.clock() + self.seconds

    def renew_if_due(self) -> None:
        """Renew when a quarter of the lease has gone by; SubmitLost if the job was failed meanwhile."""
        if time.monotonic() >= self._due:
            self._renew(self.clock() + self.seconds)

    def release(self, total: int) -> None:
        """The file is stored whole: clear the lease and set the job's total in one conditional step."""
        if not self.store.renew_submit_lease(self.job_id, None, total=total):
            raise self._lost()

    def _renew(self, until: float) -> None:
        if not self.store.renew_submit_lease(self.job_id, until):
            raise self._lost()
        self._due = time.monotonic() + self.seconds / 4

    def _lost(self) -> SubmitLost:
        return SubmitLost(
            f"job {self.job_id} was failed while this submit was stalled for over {self.seconds:g} s (its lease "
            "passed, so it was taken for dead); nothing was queued. Submit the file again"
        )


def fail_interrupted(store: Store, job_id: str, now: float | None = None) -> int | None:
    """Fail `job_id` if it is validating with its lease passed (or without one); returns how many requests its
    submit had stored, or None if it is not such a job (a live submit, or one that finished storing)."""
    error = {
        "line": 0,
        "field": None,
        "custom_id": None,
        "code": ErrorCode.SERVER_ERROR,
        "message": INTERRUPTED_MESSAGE,
    }
    return store.fail_lapsed_submit(job_id, time.time() if now is None else now, error)
