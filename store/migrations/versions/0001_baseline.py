"""Baseline: the schema of release 0.1.0 (jobs and requests), which that release created with create_all.

A database from that release has these tables and no alembic_version table; the store stamps it with this
revision and upgrades it from here.

Revision ID: 0001_baseline
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001_baseline"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "jobs",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("model", sa.String(1024), nullable=False),
        sa.Column("queue", sa.String(1024)),
        sa.Column("input_file", sa.Text()),
        sa.Column("status", sa.String(32), nullable=False),
        sa.Column("total", sa.Integer(), nullable=False),
        sa.Column("errors", sa.JSON()),
        sa.Column("options", sa.JSON()),
        sa.Column("created_at", sa.Float(), nullable=False),
        *(sa.Column(f"{s}_at", sa.Float()) for s in ("in_progress", "finalizing", "completed", "failed")),
        sa.Column("cancelling_at", sa.Float()),
        sa.Column("cancelled_at", sa.Float()),
        *(
            sa.Column(name, sa.BigInteger(), nullable=False)
            for name in (
                "prefill_tokens",
                "trie_min_tokens",
                "cache_hits",
                "cache_misses",
                "cache_evictions",
                "cache_peak_bytes",
            )
        ),
    )
    op.create_index("ix_jobs_status", "jobs", ["status"])
    op.create_table(
        "requests",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True),
        sa.Column("job_id", sa.String(64), sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("idx", sa.Integer(), nullable=False),
        sa.Column("line", sa.Integer(), nullable=False),
        sa.Column("custom_id", sa.Text(), nullable=False),
        sa.Column("endpoint", sa.String(64), nullable=False),
        sa.Column("body", sa.JSON()),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("output_text", sa.Text()),
        sa.Column("more_choices", sa.JSON()),
        sa.Column("finish_reason", sa.String(16)),
        sa.Column("prompt_tokens", sa.Integer()),
        sa.Column("cached_tokens", sa.Integer()),
        sa.Column("completion_tokens", sa.Integer()),
        sa.Column("error_code", sa.String(64)),
        sa.Column("error_message", sa.Text()),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("started_at", sa.Float()),
        sa.Column("finished_at", sa.Float()),
    )
    op.create_index("ix_requests_job_idx", "requests", ["job_id", "idx"], unique=True)
    op.create_index("ix_requests_job_status", "requests", ["job_id", "status"])


def downgrade() -> None:
    op.drop_table("requests")
    op.drop_table("jobs")
