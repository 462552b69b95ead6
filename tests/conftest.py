"""Shared fixtures: a tiny real model, a real Redis database of the tests' own, SQLite and PostgreSQL stores."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import omlx_jobs.worker  # noqa: F401  (loads OpenBLAS before anything imports mlx)
from tests.tiny_model import build_tiny_model

TEST_REDIS_URL = os.environ.get("OMLX_TEST_REDIS_URL", "redis://127.0.0.1:6379/13")
TEST_PG_URL = os.environ.get("OMLX_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def tiny_loaded(tiny_model_dir: Path):  # type: ignore[no-untyped-def]
    from omlx_jobs.worker.model import load

    return load(str(tiny_model_dir))


@pytest.fixture
def redis_url() -> Iterator[str]:
    """A real Redis server; the tests use their own database number and flush only that one."""
    import redis

    conn = redis.Redis.from_url(TEST_REDIS_URL)
    try:
        conn.ping()
    except redis.exceptions.ConnectionError as exc:
        pytest.fail(f"tests need a Redis server at {TEST_REDIS_URL} (.ci/run starts one): {exc}")
    assert conn.connection_pool.connection_kwargs.get("db", 0) != 0, "tests must not use Redis db 0"
    conn.flushdb()
    yield TEST_REDIS_URL
    conn.flushdb()


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'jobs.db'}"


def _pg_available() -> bool:
    try:
        from sqlalchemy import create_engine, text

        eng = create_engine(TEST_PG_URL)
        with eng.connect() as conn:
            conn.execute(text("select 1"))
        eng.dispose()
        return True
    except Exception:
        return False


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A fresh schema in the PostgreSQL test database, dropped afterwards."""
    if not _pg_available():
        if os.environ.get("CI"):
            pytest.fail(f"PostgreSQL is not reachable at {TEST_PG_URL} (.ci/run starts it)")
        pytest.skip(f"PostgreSQL is not reachable at {TEST_PG_URL}")
    from sqlalchemy import create_engine, text

    schema = f"t_{uuid.uuid4().hex[:10]}"
    admin = create_engine(TEST_PG_URL)
    with admin.begin() as conn:
        conn.execute(text(f"CREATE SCHEMA {schema}"))
    yield f"{TEST_PG_URL}?options=-csearch_path%3D{schema}"
    with admin.begin() as conn:
        conn.execute(text(f"DROP SCHEMA {schema} CASCADE"))
    admin.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Runs a store test once on SQLite and once on PostgreSQL."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'jobs.db'}"
    return request.getfixturevalue("pg_url")
