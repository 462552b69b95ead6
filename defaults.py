"""Every default setting in one place: the CLI, the engine, the worker and the client read them here.

A leaf module with no MLX in it (client commands import it too).
"""

from __future__ import annotations

import os

# ---- engine (`worker` and `run` options) ------------------------------------------------------------------
BATCH_SIZE = 32
"""Sequences decoded together (--batch-size)."""
PREFILL_BATCH_SIZE = 8
"""Prompts prefilled together (--prefill-batch-size)."""
PREFILL_STEP = 2048
"""Prompt tokens per prefill chunk (--prefill-step)."""
MIN_SHARED_TOKENS = 16
"""Shortest shared prefix worth a warm-up (--min-shared-tokens)."""
CACHE_MEMORY = 2 * 1024**3
"""Bytes of cached prefixes kept in memory (--cache-memory)."""
CACHE_DIR_BYTES = 10 * 1024**3
"""Cap of the prefix cache on disk (--cache-dir-size)."""
RAGGED_DECODE_ENV = "OMLX_JOBS_RAGGED_DECODE"
"""Set to 0 to decode with mlx-lm's masked attention on CUDA instead of worker/attention.py's kernel."""


CASCADE_ENV = "OMLX_JOBS_CASCADE"
"""Set to 0 to copy each row's cached prefix into it (today's path) instead of referencing it (cascade attention)."""


def ragged_decode() -> bool:
    """The default of EngineConfig.ragged_decode: on unless OMLX_JOBS_RAGGED_DECODE=0 (read when a config is made)."""
    return os.environ.get(RAGGED_DECODE_ENV, "1") != "0"


def cascade() -> bool:
    """The default of EngineConfig.cascade: on unless OMLX_JOBS_CASCADE=0 (read when a config is made)."""
    return os.environ.get(CASCADE_ENV, "1") != "0"


# ---- worker process (`worker` options) --------------------------------------------------------------------
DRAIN_TIMEOUT = 60.0
"""Seconds in-flight requests get to finish after SIGTERM / Ctrl-C (--drain-timeout)."""
HEARTBEAT_TTL = 45
"""Seconds a running shard stays claimed without a heartbeat (--heartbeat-ttl); beats come every TTL/4."""
MAX_ATTEMPTS = 10
"""A request started this many times without a result (worker crashes, engine errors) fails for good."""
LIVE_TICK_SECONDS = 2.0
"""A running shard writes its tokens prefilled and generated to the store this often, and a worker refreshes
its record (current tokens per second, requests in flight) as often while it runs a shard."""

# ---- jobs (`submit` options and request parameters) -------------------------------------------------------
SHARD_TIMEOUT = 24 * 3600
"""Seconds one shard may run (--shard-timeout)."""
MAX_TOKENS = 256
"""max_tokens of a request that gives none."""
REDIS_URL = "redis://127.0.0.1:6379/0"
"""Redis when neither --redis-url nor OMLX_JOBS_REDIS_URL says otherwise."""
