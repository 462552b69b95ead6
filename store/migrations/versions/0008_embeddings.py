"""requests.vectors: an embeddings request's vectors as float32 bytes (issue 26, store/vectors.py).

One nullable binary column; existing rows stay as they are (NULL: not an embeddings request).

Revision ID: 0008_embeddings
Revises: 0007_chat_extras
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008_embeddings"
down_revision = "0007_chat_extras"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("requests", sa.Column("vectors", sa.LargeBinary()))


def downgrade() -> None:
    with op.batch_alter_table("requests") as batch:
        batch.drop_column("vectors")
