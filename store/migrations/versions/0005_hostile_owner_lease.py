"""Tenants and the submit lease (issue 21, items 10 and 15).

- files.owner, batches.owner: the id of the API key that created the object (a hash, never the key); NULL for
  objects made before keys were tenants, or by a server without keys (every key sees those).
- jobs.submit_lease_until: while a submit stores a file, it pushes this forward; a validating job whose lease
  has passed lost its submit (killed), and reconcile fails it. NULL once the file is stored whole.

Three nullable columns and two indexes: no existing row changes.

Revision ID: 0005_owner_lease
Revises: 0004_logprobs
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005_owner_lease"
down_revision = "0004_logprobs"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("submit_lease_until", sa.Float()))
    op.add_column("files", sa.Column("owner", sa.String(64)))
    op.add_column("batches", sa.Column("owner", sa.String(64)))
    op.create_index("ix_files_owner", "files", ["owner"])
    op.create_index("ix_batches_owner", "batches", ["owner"])


def downgrade() -> None:
    op.drop_index("ix_batches_owner", "batches")
    op.drop_index("ix_files_owner", "files")
    with op.batch_alter_table("batches") as batch:
        batch.drop_column("owner")
    with op.batch_alter_table("files") as batch:
        batch.drop_column("owner")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("submit_lease_until")
