"""Alembic environment: migrations run on the connection (and in the transaction) that store/schema.py holds.

That connection carries the lock that keeps two processes from upgrading at once, so this file never opens
one of its own and never commits: schema.py commits the whole upgrade at once.
"""

from __future__ import annotations

from alembic import context

connection = context.config.attributes["connection"]
context.configure(connection=connection, target_metadata=None, render_as_batch=False)
with context.begin_transaction():  # inside the caller's transaction: no commit here
    context.run_migrations()
