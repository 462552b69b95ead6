"""requests.vectors: an embeddings request's vectors as float32 bytes (issue 26, store/vectors.py).

One nullable binary column; existing rows stay as they are (NULL: not an embeddings request).

Revision ID: 0007_embeddings
Revises: 0006_live_ticks
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007_embeddings"
down_revision = "0006_live_ticks"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("requests", sa.Column("vectors", sa.LargeBinary()))


def downgrade() -> None:
    with op.batch_alter_table("requests") as batch:
        batch.drop_column("vectors")
