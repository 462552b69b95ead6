"""requests.logprobs: a request's logprobs (and echo's prompt logprobs) when it asked for them (issue 12).

One nullable JSON column; existing rows stay as they are (NULL: no logprobs asked for).

Revision ID: 0004_logprobs
Revises: 0003_api
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004_logprobs"
down_revision = "0003_api"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("requests", sa.Column("logprobs", sa.JSON()))


def downgrade() -> None:
    with op.batch_alter_table("requests") as batch:
        batch.drop_column("logprobs")
