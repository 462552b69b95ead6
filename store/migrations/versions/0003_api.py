"""The HTTP API's tables: file objects and batches (api/, store/files.py, store/batches.py).

- files: uploaded input files (their bytes live under the server's own folder) and the output / error file
  objects of a batch (streamed from the request rows), one of each kind per job.
- batches: what the Batches API adds to a job (input file, endpoint, completion window, metadata, expiry,
  output / error file ids).

New tables only: no existing row changes.

Revision ID: 0003_api
Revises: 0002_shards
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003_api"
down_revision = "0002_shards"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "files",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("purpose", sa.String(32), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("filename", sa.Text(), nullable=False),
        sa.Column("bytes", sa.BigInteger()),
        sa.Column("lines", sa.Integer()),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("expires_at", sa.Float()),
        sa.Column("job_id", sa.String(64)),
        sa.Column("scan", sa.JSON()),
    )
    op.create_index("ix_files_purpose", "files", ["purpose"])
    op.create_index("ix_files_job_kind", "files", ["job_id", "kind"], unique=True)
    op.create_table(
        "batches",
        sa.Column("job_id", sa.String(64), sa.ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("input_file_id", sa.String(64), nullable=False),
        sa.Column("endpoint", sa.String(64), nullable=False),
        sa.Column("completion_window", sa.String(16), nullable=False),
        sa.Column("model_name", sa.String(1024)),
        sa.Column("metadata", sa.JSON()),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("expires_at", sa.Float(), nullable=False),
        sa.Column("expired_at", sa.Float()),
        sa.Column("output_expires_after", sa.Integer()),
        sa.Column("output_file_id", sa.String(64)),
        sa.Column("error_file_id", sa.String(64)),
        sa.Column("finalized_at", sa.Float()),
    )
    op.create_index("ix_batches_input_file_id", "batches", ["input_file_id"])
    op.create_index("ix_batches_expires_at", "batches", ["expires_at"])


def downgrade() -> None:
    op.drop_table("batches")
    op.drop_table("files")
