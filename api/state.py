"""What the app's routes share: the settings, the store and its API tables, and a Redis connection."""

from __future__ import annotations

import os
from typing import Any

from redis import Redis

from omlx_jobs.api.config import ServeConfig
from omlx_jobs.store import Store, open_store
from omlx_jobs.store.batches import Batches
from omlx_jobs.store.files import Files
from omlx_jobs.store.reports import Reports


class AppState:
    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        config.files_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(config.files_dir, 0o700)  # uploaded prompts: the owner's only, like the SQLite file
        self.store: Store = open_store(config.db_url)
        self.files = Files(self.store)
        self.batches = Batches(self.store)
        self.reports = Reports(self.store)
        self._redis: Redis | None = None

    @property
    def redis(self) -> Redis:
        """A client that connects on first use: the server starts, and serves the page, with Redis down."""
        if self._redis is None:
            from omlx_jobs.jobs.queue import connect

            self._redis = connect(self.config.redis_url, check=False)
        return self._redis

    def now(self) -> float:
        return self.config.clock()

    def close(self) -> None:
        self.store.close()
        if self._redis is not None:
            self._redis.close()


def state_of(request: Any) -> AppState:
    return request.app.state.omlx  # type: ignore[no-any-return]
