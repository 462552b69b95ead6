"""Live token counts and the page's request indexes (issue 23).

- job_ticks: what each worker prefilled and generated for a job, a row per worker spanning a few seconds to a
  share of the job's age (store/ticks.py), read by the page, `status` and /metrics as one index range.
- jobs.model_name: the model's short name (an alias, `--model-name`, or the model file's stem: jobs/model_names.py);
  NULL for older jobs, which show the name derived from `model`. jobs.created_at gets an index: the job list
  pages newest first.
- requests: indexes for the page's requests table, so that a status, an outcome (error code or finish reason)
  or a custom_id search pages through a job of a million requests as an index range.

Revision ID: 0006_live_ticks
Revises: 0005_owner_lease
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006_live_ticks"
down_revision = "0005_owner_lease"
branch_labels = None
depends_on = None

_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "job_ticks",
        sa.Column("id", _ID, primary_key=True),
        sa.Column("job_id", sa.String(64), sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("worker", sa.String(255), nullable=False),
        sa.Column("started_at", sa.Float(), nullable=False),
        sa.Column("ended_at", sa.Float(), nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("completion_tokens", sa.BigInteger(), nullable=False),
        sa.Column("in_flight", sa.Integer(), nullable=False),
    )
    op.create_index("ix_job_ticks_job_end", "job_ticks", ["job_id", "ended_at"])
    op.add_column("jobs", sa.Column("model_name", sa.String(255)))
    op.create_index("ix_jobs_created_at", "jobs", ["created_at"])
    op.create_index("ix_requests_job_status_idx", "requests", ["job_id", "status", "idx"])
    op.create_index("ix_requests_job_custom_id", "requests", ["job_id", "custom_id"])
    op.create_index(
        "ix_requests_job_outcome_idx", "requests", ["job_id", sa.text("coalesce(error_code, finish_reason)"), "idx"]
    )


def downgrade() -> None:
    for name in ("ix_requests_job_outcome_idx", "ix_requests_job_custom_id", "ix_requests_job_status_idx"):
        op.drop_index(name, "requests")
    op.drop_index("ix_jobs_created_at", "jobs")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("model_name")
    op.drop_table("job_ticks")
