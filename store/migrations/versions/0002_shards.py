"""Shards and shard runs in the store; requests get their prefix-order position, sort key and run.

- requests.sort_key: submit's compact prefix key (empty for old rows: they keep file order); prefix order is
  (sort_key, idx), and the index (job_id, status) becomes (job_id, status, sort_key, idx), so a shard's
  pending requests are one index range. requests.run_id: the shard run that produced the result.
- shards: the cut of each job, prefix accounting per shard, and failures before any request started.
- shard_runs: which worker ran which shard on which model, with its request counts.
- Text columns now go through store/textcodec.py: a U+FDD0 already stored is escaped, so it reads back as is.

Revision ID: 0002_shards
Revises: 0001_baseline
"""

from __future__ import annotations

import json

import sqlalchemy as sa
from alembic import op

revision = "0002_shards"
down_revision = "0001_baseline"
branch_labels = None
depends_on = None

_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
MARK = "\ufdd0"
END_KEY = b"\xff" * 256  # above every key (keys are at most 160 bytes): the last shard's end (store/shards.py)


def upgrade() -> None:
    op.add_column("requests", sa.Column("sort_key", sa.LargeBinary()))
    op.add_column("requests", sa.Column("run_id", sa.Integer()))
    # Bound as bytes, so SQLite stores a BLOB like every new key (a '' literal would be TEXT, which sorts apart).
    op.execute(
        sa.text("UPDATE requests SET sort_key = :empty").bindparams(sa.bindparam("empty", b"", sa.LargeBinary()))
    )
    for column in ("custom_id", "output_text", "error_message"):
        op.execute(
            sa.text(
                f"UPDATE requests SET {column} = replace({column}, :m, :escaped) WHERE {column} LIKE :like"
            ).bindparams(m=MARK, escaped=MARK + "1", like=f"%{MARK}%")
        )
    # Replaces (job_id, status): the same prefix for counts, and a shard's pending requests in one range.
    op.create_index("ix_requests_job_status_key", "requests", ["job_id", "status", "sort_key", "idx"])
    op.drop_index("ix_requests_job_status", "requests")

    shards = op.create_table(
        "shards",
        sa.Column("id", _ID, primary_key=True),
        sa.Column("job_id", sa.String(64), sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("first_pos", sa.Integer(), nullable=False),
        sa.Column("end_pos", sa.Integer(), nullable=False),
        sa.Column("first_key", sa.LargeBinary(), nullable=False),
        sa.Column("first_idx", sa.Integer(), nullable=False),
        sa.Column("end_key", sa.LargeBinary(), nullable=False),
        sa.Column("end_idx", sa.Integer(), nullable=False),
        sa.Column("group_first", sa.Integer(), nullable=False),
        sa.Column("group_last", sa.Integer(), nullable=False),
        sa.Column("lead_rows", sa.Integer(), nullable=False),
        sa.Column("tail_rows", sa.Integer(), nullable=False),
        sa.Column("trie_min_tokens", sa.BigInteger()),
        sa.Column("lead_tokens", sa.LargeBinary()),
        sa.Column("tail_tokens", sa.LargeBinary()),
        sa.Column("failures", sa.Integer(), nullable=False),
        sa.Column("last_error", sa.Text()),
    )
    op.create_index("ix_shards_job_first", "shards", ["job_id", "first_pos"], unique=True)
    op.create_table(
        "shard_runs",
        sa.Column("id", _ID, primary_key=True),
        sa.Column("job_id", sa.String(64), sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("first_pos", sa.Integer(), nullable=False),
        sa.Column("end_pos", sa.Integer()),
        sa.Column("worker", sa.String(255), nullable=False),
        sa.Column("model", sa.String(1024), nullable=False),
        sa.Column("started_at", sa.Float(), nullable=False),
        sa.Column("finished_at", sa.Float()),
        sa.Column("completed", sa.Integer(), nullable=False),
        sa.Column("failed", sa.Integer(), nullable=False),
        sa.Column("outcome", sa.String(32), nullable=False),
        sa.Column("error", sa.Text()),
    )
    op.create_index("ix_shard_runs_job", "shard_runs", ["job_id"])
    _cut_existing_jobs(shards)


def _cut_existing_jobs(shards: sa.Table) -> None:
    """Shards for the jobs already stored, cut as 0.1.0 cut them (options.shard_size, else one per job).

    A job that was planned already (its trie minimum is set) keeps its minimum: its shards count as recorded.
    """
    conn = op.get_bind()
    rows = []
    for job_id, total, options, trie_min in conn.execute(
        sa.text("SELECT id, total, options, trie_min_tokens FROM jobs WHERE total > 0")
    ):
        opts = json.loads(options) if isinstance(options, str) else (options or {})
        size = int(opts.get("shard_size") or total)
        for n, start in enumerate(range(0, total, size)):
            end = min(start + size, total)
            rows.append(
                {
                    "job_id": job_id,
                    "first_pos": start,
                    "end_pos": end,
                    # Old rows have an empty key, so prefix order is file order and a shard an idx range.
                    "first_key": b"",
                    "first_idx": start,
                    "end_key": b"" if end < total else END_KEY,
                    "end_idx": end if end < total else 0,
                    "group_first": n,
                    "group_last": n,
                    "lead_rows": 0,
                    "tail_rows": 0,
                    "trie_min_tokens": 0 if trie_min else None,
                    "failures": 0,
                }
            )
    if rows:
        op.bulk_insert(shards, rows)


def downgrade() -> None:
    op.drop_table("shard_runs")
    op.drop_table("shards")
    op.create_index("ix_requests_job_status", "requests", ["job_id", "status"])
    op.drop_index("ix_requests_job_status_key", "requests")
    for column in ("run_id", "sort_key"):
        op.drop_column("requests", column)
