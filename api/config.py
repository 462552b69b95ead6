"""The server's settings: API keys, model aliases, upload caps and its own folder for input files."""

from __future__ import annotations

import ipaddress
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_MAX_UPLOAD_BYTES = 512 * 1024**2
DEFAULT_MAX_UPLOAD_LINES = 1_000_000
DEFAULT_FILE_TTL = 30 * 24 * 3600
"""Uploaded batch files expire after 30 days unless expires_after says otherwise, as OpenAI's do."""
COMPLETION_WINDOWS = {"24h": 24 * 3600}
"""The only window OpenAI accepts, and so the only one the API accepts."""
API_KEYS_ENV = "OMLX_JOBS_API_KEYS"
ADMIN_API_KEYS_ENV = "OMLX_JOBS_ADMIN_API_KEYS"


class ConfigError(ValueError):
    """A setting that cannot work; the message says which and what to do."""


@dataclass
class ServeConfig:
    """Everything `create_app` needs. Tests build one directly; `omlx-jobs serve` builds it from its options."""

    db_url: str
    redis_url: str
    files_dir: Path
    api_keys: tuple[str, ...] = ()
    """Tenant keys: each sees only the files and batches it created (api/tenants.py)."""
    admin_keys: tuple[str, ...] = ()
    """Keys that see and act on every tenant's objects."""
    models: dict[str, str] = field(default_factory=dict)
    """Model names (or aliases) a batch may name in body.model -> the model string workers serve."""
    max_upload_bytes: int = DEFAULT_MAX_UPLOAD_BYTES
    max_upload_lines: int = DEFAULT_MAX_UPLOAD_LINES
    default_file_ttl: int = DEFAULT_FILE_TTL
    shard_size: int | None = None
    sweep_seconds: float = 5.0
    """How often the server expires batches past their window, sets output files and deletes expired files."""
    page_refresh_seconds: float = 2.0
    clock: Callable[[], float] = time.time
    """Wall clock for completion windows and file expiry; tests pass one they can advance."""

    def __post_init__(self) -> None:
        self.files_dir = Path(self.files_dir)
        if self.max_upload_bytes <= 0 or self.max_upload_lines <= 0:
            raise ConfigError("upload caps must be positive")
        for name, ref in self.models.items():
            if not name or not ref:
                raise ConfigError(f"--model {name}={ref}: give NAME=MODEL or MODEL")


def parse_api_keys(
    cli_keys: tuple[str, ...] | list[str], env: str | None = None, *, env_name: str = API_KEYS_ENV
) -> tuple[str, ...]:
    """Keys from --api-key (repeatable) and OMLX_JOBS_API_KEYS (comma-separated); blanks dropped. With
    env_name=ADMIN_API_KEYS_ENV, the same for --admin-api-key."""
    env = os.environ.get(env_name, "") if env is None else env
    keys = [k.strip() for k in (*cli_keys, *env.split(",")) if k and k.strip()]
    for key in keys:
        if len(key) < 8:
            raise ConfigError("API keys must be at least 8 characters; generate one with `openssl rand -hex 24`")
    return tuple(dict.fromkeys(keys))


def parse_models(specs: tuple[str, ...] | list[str]) -> dict[str, str]:
    """`NAME=MODEL` makes NAME an alias of MODEL; a bare `MODEL` is served under its own name."""
    out: dict[str, str] = {}
    for spec in specs:
        name, sep, ref = spec.partition("=")
        # gguf:PATH and folder paths may hold '=' only after a separator, so split at the first one.
        name, ref = (name.strip(), ref.strip()) if sep else (spec.strip(), spec.strip())
        if not name or not ref:
            raise ConfigError(f"--model {spec!r}: give NAME=MODEL or MODEL")
        out[name] = ref
    return out


def is_loopback(host: str) -> bool:
    """True for localhost and loopback addresses; any other name or address counts as reachable from outside."""
    if host.strip("[]").lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_listen(host: str, api_keys: tuple[str, ...]) -> None:
    """Refuse to listen beyond loopback without a key: anyone who reaches the port could run and read jobs."""
    if not api_keys and not is_loopback(host):
        raise ConfigError(
            f"refusing to listen on {host} without an API key: anyone who can reach it could read and run jobs. "
            f"Pass --api-key KEY (or set {API_KEYS_ENV}), or listen on 127.0.0.1"
        )
