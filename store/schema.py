"""Bring a database to the current schema with Alembic, safely when several processes open it at once.

A store upgrades when it opens. The common case (already current) costs one small query and never imports
Alembic. Otherwise one process at a time migrates, under a lock: SQLite's write lock (BEGIN IMMEDIATE) or a
PostgreSQL advisory lock, held in the transaction that runs every step, so a crash leaves the old schema.
A database from release 0.1.0 (tables made by create_all, no alembic_version) is stamped as the baseline
first and upgraded from there, in place.
"""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import Connection, Engine, inspect, text

from omlx_jobs.store.migrations import BASELINE, HEAD

MIGRATIONS = Path(__file__).resolve().parent / "migrations"
_PG_LOCK_KEY = 0x6F6D6C78  # "omlx": one advisory lock for every omlx-jobs schema upgrade on a server


def revision(conn: Connection) -> str | None:
    """The database's Alembic revision; None for a database without one (new, or from release 0.1.0)."""
    if not inspect(conn).has_table("alembic_version"):
        return None
    return conn.execute(text("SELECT version_num FROM alembic_version")).scalar()


def has_tables(conn: Connection) -> bool:
    return inspect(conn).has_table("jobs")


def upgrade(engine: Engine) -> bool:
    """Migrate the database to HEAD if it is behind; True if this call changed it."""
    with engine.connect() as conn:
        if revision(conn) == HEAD:
            return False
    with engine.connect() as conn:
        if engine.dialect.name == "sqlite":
            # pysqlite's own transaction handling would commit early; take the write lock by hand instead.
            conn = conn.execution_options(isolation_level="AUTOCOMMIT")
            conn.exec_driver_sql("BEGIN IMMEDIATE")
        else:
            conn.begin()
            if engine.dialect.name == "postgresql":
                conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _PG_LOCK_KEY})
        try:
            changed = _migrate(conn)
        except BaseException:
            if engine.dialect.name == "sqlite":
                conn.exec_driver_sql("ROLLBACK")
            conn.rollback()
            raise
        if engine.dialect.name == "sqlite":
            conn.exec_driver_sql("COMMIT")
        conn.commit()
        return changed


def _migrate(conn: Connection) -> bool:
    current = revision(conn)
    if current == HEAD:  # another process upgraded it while this one waited for the lock
        return False
    from alembic import command
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.attributes["connection"] = conn
    if current is None and has_tables(conn):
        command.stamp(config, BASELINE)  # release 0.1.0 made these tables with create_all
    command.upgrade(config, "head")
    return True
