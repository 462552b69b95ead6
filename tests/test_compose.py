"""compose.yaml and the Dockerfile, parsed only (Docker does not run in the tests)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from sqlalchemy.engine import make_url

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


def interpolate(value: str) -> str:
    """Compose's `${VAR:-default}` as the default (a set variable would win in Compose; the tests have none)."""
    return DEFAULT.sub(lambda m: m.group(2) or "", value)


def as_dict(value: Any) -> dict[str, Any]:
    """Compose allows `environment` and `depends_on` as lists or mappings."""
    if isinstance(value, dict):
        return value
    out: dict[str, Any] = {}
    for item in value or []:
        key, _, val = str(item).partition("=")
        out[key] = val or None
    return out


@pytest.fixture(scope="module")
def services() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]


@pytest.fixture(scope="module")
def worker_env(services: dict[str, Any]) -> dict[str, str]:
    return {k: interpolate(str(v)) for k, v in as_dict(services["worker"]["environment"]).items()}


def test_three_services_on_the_expected_images(services: dict[str, Any]) -> None:
    assert {"redis", "postgres", "worker"} <= set(services)
    assert services["redis"]["image"].startswith("redis:7")
    assert services["postgres"]["image"].startswith("postgres:16")
    assert services["postgres"]["healthcheck"]["test"]


def test_worker_waits_for_redis_and_a_healthy_postgres(services: dict[str, Any]) -> None:
    depends = as_dict(services["worker"]["depends_on"])
    assert {"redis", "postgres"} <= set(depends)
    assert depends["postgres"]["condition"] == "service_healthy"


def test_worker_urls_point_at_the_services(worker_env: dict[str, str]) -> None:
    redis = urlsplit(worker_env["OMLX_JOBS_REDIS_URL"])
    assert (redis.scheme, redis.hostname, redis.port or 6379) == ("redis", "redis", 6379)
    db = make_url(worker_env["OMLX_JOBS_DATABASE_URL"])
    assert db.drivername == "postgresql+psycopg"  # the driver the `postgres` extra installs
    assert (db.host, db.port or 5432) == ("postgres", 5432)


def test_postgres_database_and_user_match_the_worker_url(services: dict[str, Any], worker_env: dict[str, str]) -> None:
    pg = {k: interpolate(str(v)) for k, v in as_dict(services["postgres"]["environment"]).items()}
    db = make_url(worker_env["OMLX_JOBS_DATABASE_URL"])
    assert db.database == pg["POSTGRES_DB"] == "omlx"
    assert db.username == pg.get("POSTGRES_USER", "postgres")
    assert db.password == pg["POSTGRES_PASSWORD"]
    assert pg["POSTGRES_DB"] in " ".join(services["postgres"]["healthcheck"]["test"])


def test_worker_runs_omlx_jobs_worker_with_a_model(services: dict[str, Any]) -> None:
    command = services["worker"]["command"]
    args = shlex.split(command) if isinstance(command, str) else [str(a) for a in command]
    assert args[:2] == ["omlx-jobs", "worker"]
    assert "--model" in args
    model = args[args.index("--model") + 1]
    assert "OMLX_MODEL" in model  # chosen by whoever starts the stack
    assert any(":/models" in str(v) for v in services["worker"]["volumes"])


def test_dockerfile_installs_the_package_with_cpu_and_postgres(services: dict[str, Any]) -> None:
    build = services["worker"]["build"]
    context = build if isinstance(build, str) else build.get("context", ".")
    dockerfile = "Dockerfile" if isinstance(build, str) else build.get("dockerfile", "Dockerfile")
    text = (ROOT / context / dockerfile).read_text()
    assert re.search(r"^FROM python:3\.11-slim", text, re.M)
    extras = re.search(r"pip install [^\n]*['\"]?\.\[([a-z0-9,]+)\]", text)
    assert extras and {"cpu", "postgres", "serve"} <= set(extras.group(1).split(","))
    assert "libopenblas0-pthread" in text  # preloaded for MLX's CPU backend (worker/models/blas.py)
    for copied in ("pyproject.toml", "defaults.py", "errors.py", "cli", "jobs", "store", "worker", "api"):
        assert re.search(rf"^COPY .*\b{re.escape(copied)}\b", text, re.M), copied


def _args(command: Any) -> list[str]:
    return shlex.split(command) if isinstance(command, str) else [str(a) for a in command]


def test_server_serves_the_api_beyond_loopback_only_with_a_key(services: dict[str, Any]) -> None:
    server = services["server"]
    args = _args(server["command"])
    assert args[:2] == ["omlx-jobs", "serve"]
    host = args[args.index("--host") + 1]
    env = as_dict(server["environment"])
    if host not in ("127.0.0.1", "localhost"):
        # `serve` refuses a non-loopback address without a key, so compose must demand one (no default).
        assert re.fullmatch(r"\$\{OMLX_JOBS_API_KEYS:\?[^}]+\}", str(env["OMLX_JOBS_API_KEYS"]))
    port = args[args.index("--port") + 1]
    assert any(str(p).startswith("127.0.0.1:") and str(p).endswith(f":{port}") for p in server["ports"])
    files_dir = args[args.index("--files-dir") + 1]
    assert any(str(v).endswith(f":{files_dir}") for v in server["volumes"])
    assert "/healthz" in " ".join(server["healthcheck"]["test"]) and port in " ".join(server["healthcheck"]["test"])


def test_server_shares_the_workers_store_queue_and_image(services: dict[str, Any], worker_env: dict[str, str]) -> None:
    server = services["server"]
    env = {k: interpolate(str(v)) for k, v in as_dict(server["environment"]).items()}
    assert env["OMLX_JOBS_REDIS_URL"] == worker_env["OMLX_JOBS_REDIS_URL"]
    assert env["OMLX_JOBS_DATABASE_URL"] == worker_env["OMLX_JOBS_DATABASE_URL"]
    assert server["build"] == services["worker"]["build"]
    depends = as_dict(server["depends_on"])
    assert depends["postgres"]["condition"] == "service_healthy" and "redis" in depends


def test_workers_are_replicas_sharing_one_store_and_queue(services: dict[str, Any]) -> None:
    worker = services["worker"]
    replicas = int(interpolate(str(worker["deploy"]["replicas"])))
    assert replicas >= 2  # several workers on one job by default
    assert "container_name" not in worker and "ports" not in worker  # either would stop Compose scaling it
    env = as_dict(worker["environment"])
    assert "OMLX_JOBS_DATABASE_URL" in env and "OMLX_JOBS_DB" not in env  # PostgreSQL, not a per-replica file
    command = worker["command"]
    args = _args(command)
    assert "--name" not in args and "--queue" not in args  # unique RQ names; the model's queue for all
