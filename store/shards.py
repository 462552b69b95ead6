"""The store's shards and shard runs: the cut of each job, prefix accounting per shard, who ran what.

A mixin of Store (store/db.py), which holds the engine and the url.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from sqlalchemy import ColumnElement, Engine, and_, case, func, insert, select, tuple_, update

from omlx_jobs.store.errors import retrying
from omlx_jobs.store.models import Job, Request, RequestStatus, Shard, ShardRun

END_KEY = b"\xff" * 256
"""Above every sort key (keys are at most 160 bytes): the end bound of a job's last shard."""


@dataclass(frozen=True)
class ShardCut:
    """One shard as submit cuts it: its positions, bounds in (sort_key, idx) order, prefix groups
    (see models.Shard)."""

    first_pos: int
    end_pos: int
    first_key: bytes = b""
    first_idx: int = 0
    end_key: bytes = END_KEY
    end_idx: int = 0
    group_first: int = 0
    group_last: int = 0
    lead_rows: int = 0
    tail_rows: int = 0


@dataclass(frozen=True)
class ShardInfo:
    first_pos: int
    end_pos: int
    group_first: int
    group_last: int
    lead_rows: int
    tail_rows: int
    trie_min_tokens: int | None
    failures: int
    last_error: str | None


SETTLED_OUTCOMES = ("done", "stopped")
"""Shard-run outcomes whose accounting (prefill tokens, cache figures) reached the job."""


@dataclass(frozen=True)
class WorkerShare:
    """What one worker did for a job: its model, shard runs and finished requests."""

    worker: str
    model: str
    shard_runs: int
    completed: int
    failed: int
    last_finished_at: float | None
    unsettled_runs: int = 0
    """Its runs that ended neither done nor stopped (killed, failed): their prefill tokens were never added to the
    job's (a run adds them when it ends), so the job's computed figure is partial."""


_INFO_COLUMNS = [getattr(Shard, f) for f in ShardInfo.__dataclass_fields__]


def in_shard(shard: Any) -> ColumnElement[bool]:
    """Requests of a shard (a Shard row or alias, or any object with its bounds): one index range."""
    order = tuple_(Request.sort_key, Request.idx)
    return and_(order >= tuple_(shard.first_key, shard.first_idx), order < tuple_(shard.end_key, shard.end_idx))


def shared_tokens(a: bytes | None, b: bytes | None) -> int:
    """Tokens in the common prefix of two big-endian uint32 token strings (planner.token_key's encoding)."""
    if not a or not b:
        return 0
    hi = min(len(a), len(b)) // 4
    if a[: hi * 4] == b[: hi * 4]:
        return hi
    lo = 0  # a[:lo] == b[:lo]; a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[: mid * 4] == b[: mid * 4]:
            lo = mid
        else:
            hi = mid
    return lo


class ShardStore:
    url: str
    engine: Engine

    # ---- submit: positions and the cut ----------------------------------------------------------------

    def iter_pending_keys(self, job_id: str, batch_size: int = 5000) -> Iterator[tuple[bytes, int]]:
        """(sort_key, idx) of the job's pending requests in prefix order, streamed: an index scan, so the
        database sorts and submit keeps no key in memory however large the file."""
        with self.engine.connect() as conn:
            rows = conn.execution_options(stream_results=True, yield_per=batch_size).execute(
                select(Request.sort_key, Request.idx)
                .where(Request.job_id == job_id, Request.status == RequestStatus.PENDING)
                .order_by(Request.sort_key, Request.idx)
            )
            for key, idx in rows:
                yield key or b"", idx

    @retrying
    def add_shards(self, job_id: str, cuts: list[ShardCut]) -> None:
        """Store the job's cut (replacing any earlier one)."""
        from sqlalchemy import delete

        with self.engine.begin() as conn:
            conn.execute(delete(Shard).where(Shard.job_id == job_id))
            for start in range(0, len(cuts), 1000):
                conn.execute(
                    insert(Shard),
                    [{"job_id": job_id, "failures": 0, **c.__dict__} for c in cuts[start : start + 1000]],
                )

    # ---- reading shards ---------------------------------------------------------------------------

    @retrying
    def shards(self, job_id: str, *, pending_only: bool = False, group: int | None = None) -> list[ShardInfo]:
        """The job's shards in pos order; with pending_only, those holding a request without a result, and
        with `group`, those whose first request is in that prefix group."""
        stmt = select(*_INFO_COLUMNS).where(Shard.job_id == job_id)
        if group is not None:
            stmt = stmt.where(Shard.group_first == group)
        if pending_only:
            pending = select(Request.id).where(
                Request.job_id == job_id, Request.status == RequestStatus.PENDING, in_shard(Shard)
            )
            stmt = stmt.where(pending.exists())
        with self.engine.connect() as conn:
            return [ShardInfo(*r) for r in conn.execute(stmt.order_by(Shard.first_pos))]

    @retrying
    def shard_bounds(self, job_id: str, first_pos: int) -> ShardCut | None:
        """The bounds of the shard starting at `first_pos`, or None if the job has no such shard."""
        cols = [getattr(Shard, f) for f in ShardCut.__dataclass_fields__]
        with self.engine.connect() as conn:
            row = conn.execute(select(*cols).where(Shard.job_id == job_id, Shard.first_pos == first_pos)).first()
        return ShardCut(*row) if row is not None else None

    @retrying
    def get_shard(self, job_id: str, first_pos: int) -> ShardInfo | None:
        with self.engine.connect() as conn:
            row = conn.execute(
                select(*_INFO_COLUMNS).where(Shard.job_id == job_id, Shard.first_pos == first_pos)
            ).first()
        return ShardInfo(*row) if row is not None else None

    # ---- prefix accounting --------------------------------------------------------------------------

    @retrying
    def record_shard_plan(self, job_id: str, first_pos: int, trie_min: int, lead: bytes, tail: bytes) -> bool:
        """Record a shard's trie minimum once, and add it to the job's minimum less what it shares with its
        already recorded neighbours: the common prefix of this shard's `lead` (the common token prefix of its
        first prefix group) and the previous shard's tail, and of its `tail` and the next shard's lead.

        Each subtracted token is in both neighbours' tries, and a token in k shards is subtracted at most
        k - 1 times (once per adjacent pair holding it), so the job's minimum is never below the true
        distinct-token count; it equals it when shards share tokens only along those common prefixes (a
        system prompt, few-shot turns, an instruction) and a prefix's shards are adjacent, as prefix order
        makes them. Whichever neighbour records second subtracts their overlap, so order does not matter.

        The job row is locked first (an UPDATE), so two shards recording at once see each other.
        Returns False if the shard had recorded before (a re-run adds nothing).
        """
        with self.engine.begin() as conn:
            conn.execute(update(Job).where(Job.id == job_id).values(trie_min_tokens=Job.trie_min_tokens))
            row = conn.execute(
                select(Shard.id, Shard.end_pos, Shard.trie_min_tokens).where(
                    Shard.job_id == job_id, Shard.first_pos == first_pos
                )
            ).first()
            if row is None or row.trie_min_tokens is not None:
                return False
            shard_id, end_pos, _ = row
            recorded = Shard.trie_min_tokens.is_not(None)
            before = conn.execute(
                select(Shard.tail_tokens).where(Shard.job_id == job_id, Shard.end_pos == first_pos, recorded)
            ).scalar()
            after = conn.execute(
                select(Shard.lead_tokens).where(Shard.job_id == job_id, Shard.first_pos == end_pos, recorded)
            ).scalar()
            overlap = shared_tokens(before, lead) + shared_tokens(tail, after)
            conn.execute(
                update(Shard)
                .where(Shard.id == shard_id)
                .values(trie_min_tokens=trie_min, lead_tokens=lead, tail_tokens=tail)
            )
            conn.execute(
                update(Job).where(Job.id == job_id).values(trie_min_tokens=Job.trie_min_tokens + (trie_min - overlap))
            )
            return True

    # ---- failures before any request started -----------------------------------------------------------

    @retrying
    def record_shard_failure(self, job_id: str, first_pos: int, error: str) -> int:
        """Count a run of the shard that failed before any request started; returns the count so far."""
        where = and_(Shard.job_id == job_id, Shard.first_pos == first_pos)
        with self.engine.begin() as conn:
            conn.execute(update(Shard).where(where).values(failures=Shard.failures + 1, last_error=error[:4000]))
            return int(conn.execute(select(Shard.failures).where(where)).scalar() or 0)

    @retrying
    def reset_shard_failures(self, job_id: str) -> None:
        """A retry gives every shard a fresh allowance."""
        with self.engine.begin() as conn:
            conn.execute(update(Shard).where(Shard.job_id == job_id).values(failures=0, last_error=None))

    # ---- shard runs: who ran what --------------------------------------------------------------------

    @retrying
    def start_run(self, job_id: str, first_pos: int, end_pos: int | None, worker: str, model: str) -> int:
        """Record that `worker`, serving `model`, starts a shard; returns the run id results refer to."""
        with self.engine.begin() as conn:
            result = conn.execute(
                insert(ShardRun).values(
                    job_id=job_id,
                    first_pos=first_pos,
                    end_pos=end_pos,
                    worker=worker[:255],
                    model=model[:1024],
                    started_at=time.time(),
                    completed=0,
                    failed=0,
                    outcome="running",
                )
            )
            return int(result.inserted_primary_key[0])

    @retrying
    def finish_run(self, run_id: int, outcome: str, error: str | None = None) -> None:
        with self.engine.begin() as conn:
            conn.execute(
                update(ShardRun)
                .where(ShardRun.id == run_id)
                .values(outcome=outcome, error=error[:4000] if error else None, finished_at=time.time())
            )

    @retrying
    def job_workers(self, job_id: str) -> list[WorkerShare]:
        """The workers that ran the job's shards, with their request counts, busiest first."""
        with self.engine.connect() as conn:
            rows = conn.execute(
                select(
                    ShardRun.worker,
                    ShardRun.model,
                    func.count(),
                    func.coalesce(func.sum(ShardRun.completed), 0),
                    func.coalesce(func.sum(ShardRun.failed), 0),
                    func.max(ShardRun.finished_at),
                    func.coalesce(func.sum(case((ShardRun.outcome.in_(SETTLED_OUTCOMES), 0), else_=1)), 0),
                )
                .where(ShardRun.job_id == job_id)
                .group_by(ShardRun.worker, ShardRun.model)
            ).all()
        shares = [WorkerShare(r[0], r[1], int(r[2]), int(r[3]), int(r[4]), r[5], int(r[6])) for r in rows]
        return sorted(shares, key=lambda w: (-w.completed, w.worker))

    @retrying
    def run_models(self, job_id: str) -> dict[int, str]:
        """run id -> the model that run served: results name the model that actually ran."""
        with self.engine.connect() as conn:
            rows = conn.execute(select(ShardRun.id, ShardRun.model).where(ShardRun.job_id == job_id))
            return {int(r[0]): r[1] for r in rows}


__all__ = ["ShardCut", "ShardInfo", "ShardStore", "WorkerShare", "shared_tokens"]
