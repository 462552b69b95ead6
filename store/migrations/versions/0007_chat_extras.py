"""requests.chat_extras: each choice's reasoning_content, tool calls and reasoning tokens (issue 24).

One nullable JSON column; existing rows stay as they are (NULL: a plain answer in output_text).

Revision ID: 0007_chat_extras
Revises: 0006_live_ticks
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007_chat_extras"
down_revision = "0006_live_ticks"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("requests", sa.Column("chat_extras", sa.JSON()))


def downgrade() -> None:
    with op.batch_alter_table("requests") as batch:
        batch.drop_column("chat_extras")
