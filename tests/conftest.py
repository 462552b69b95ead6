"""Shared fixtures: a tiny real model, a Redis server of the tests' own, SQLite and PostgreSQL stores."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import omlx_jobs.worker  # noqa: F401  (loads OpenBLAS before anything imports mlx)
from tests.fault_harness import RedisServer
from tests.tiny_model import build_tiny_model

TEST_REDIS_URL = os.environ.get("OMLX_TEST_REDIS_URL", "")
TEST_PG_URL = os.environ.get("OMLX_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def tiny_loaded(tiny_model_dir: Path):  # type: ignore[no-untyped-def]
    from omlx_jobs.worker.loading import load

    return load(str(tiny_model_dir))


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Redis server of this test session's own, on a free loopback port: the suite never touches a Redis it did
    not start, so two suites on one machine (or a user's own Redis) keep their data.

    OMLX_TEST_REDIS_URL points the suite at an existing server instead; its database must be empty at the start
    (checked), and only that database is flushed between tests."""
    import redis

    if TEST_REDIS_URL:
        conn = redis.Redis.from_url(TEST_REDIS_URL)
        try:
            size = conn.dbsize()
        except redis.exceptions.ConnectionError as exc:
            pytest.fail(f"OMLX_TEST_REDIS_URL={TEST_REDIS_URL} is not reachable: {exc}")
        if size:
            pytest.fail(f"OMLX_TEST_REDIS_URL={TEST_REDIS_URL} holds {size} keys: give the tests an empty database")
        yield TEST_REDIS_URL
        return
    if shutil.which("redis-server") is None:
        pytest.fail("tests need redis-server on PATH (scripts/setup --services installs it)")
    with RedisServer(tmp_path_factory.mktemp("redis")) as server:
        yield server.url()


@pytest.fixture
def redis_url(redis_server: str) -> Iterator[str]:
    """A real Redis database that belongs to the tests, emptied before and after each test."""
    import redis

    conn = redis.Redis.from_url(redis_server)
    conn.flushdb()
    yield redis_server
    conn.flushdb()
    conn.close()


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
