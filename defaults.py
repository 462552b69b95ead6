"""Every default setting in one place: the CLI, the engine, the worker and the client read them here.

A leaf module with no MLX in it (client commands import it too). The engine's switches are `Switches`, read
from the environment once per EngineConfig (`Switches.from_env`); no module reads the environment at import.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

# ---- engine (`worker` and `run` options) ------------------------------------------------------------------
BATCH_SIZE = 32
"""Sequences decoded together (--batch-size)."""
PREFILL_BATCH_SIZE = 8
"""Prompts prefilled together, at least (--prefill-batch-size); more while they fit PREFILL_TOKENS."""
PREFILL_TOKENS = 8192
"""Padded prompt tokens (rows x the longest row's chunk) a prefill pass may grow to beyond PREFILL_BATCH_SIZE
rows: a prefix group's short suffixes then prefill in one pass instead of one per 8 rows. On the H200 a pass
with prompt processing cost about 100 ms whether it took 8 or 32 rows (bench/engine/step_trace.py)."""
REFILL_FRACTION = 8
"""A decode batch is refilled once 1/REFILL_FRACTION of its rows are free (or when it runs below half full),
not each time a row finishes: every refill is a prompt pass that stalls the whole batch."""
PREFILL_STEP = 2048
"""Prompt tokens per prefill chunk (--prefill-step)."""
EMBED_BATCH_TOKENS = 16384
"""Padded tokens per embedding forward pass (rows x longest row): bounds its activations (worker/embeddings/)."""
EMBED_BATCH_ROWS = 256
"""Most inputs in one embedding forward pass."""
EMBED_PAD_TO_CUDA = 32
"""On CUDA an embedding batch pads its rows to a multiple of this many tokens: each new attention shape costs a
cuDNN plan there, so varied lengths share a few (worker/embeddings/engine.py)."""
MIN_SHARED_TOKENS = 16
"""Shortest shared prefix worth a warm-up (--min-shared-tokens)."""
CACHE_MEMORY = 2 * 1024**3
"""Bytes of cached prefixes kept in memory (--cache-memory)."""
CACHE_DIR_BYTES = 10 * 1024**3
"""Cap of the prefix cache on disk (--cache-dir-size)."""
FUSED_ROWS_PER_CALL = 32
"""Rows per block of a fused cascade decode call: each row reads the other rows' own keys of its block too
(masked), so more rows per block cost compute, fewer cost reads of the levels (worker/attention/fused.py)."""
CASCADE_MIN_LEVEL_TOKENS = 32
"""Shorter shared levels are not worth an attention call each per layer and step: such a cut is skipped, and a
short tail is copied into the row instead (worker/backend/cascade_batch.py)."""

CASCADE_GPU_MIN_REFERENCE_TOKENS = 512
"""On a GPU, a shared level shorter than this is copied into its rows rather than referenced (cascade_cost.py's
min_tokens): H200 measurements of issue 22 in bench/RESULTS.md."""

Mode = Literal["auto", "always", "never"]
"""A switch that can also follow the device: "auto" is on on GPUs (Metal, CUDA) and off on the CPU."""


@dataclass(frozen=True)
class Switches:
    """The engine's switches, one field each. `from_env` reads the environment variables named below, once;
    tests and benchmarks build one instead. EngineConfig carries it to the backend and the attention routing."""

    cascade: bool = True
    """OMLX_JOBS_CASCADE=0: copy each row's cached prefix into it instead of referencing it (cascade attention)."""
    ragged_decode: bool = True
    """OMLX_JOBS_RAGGED_DECODE=0: on CUDA, decode with mlx-lm's masked attention instead of the ragged kernel (and
    without the cascade kernels, which come with it)."""
    cascade_prefix_kernel: bool = True
    """OMLX_JOBS_CASCADE_PREFIX_KERNEL=0: attend CUDA decode steps' prefix levels in mx ops, not on tensor cores."""
    cascade_fused_prefill: Mode = "auto"
    """OMLX_JOBS_CASCADE_FUSED_PREFILL: prefill one prefix group through mlx's fused attention ("0" never, "1"
    everywhere, else on GPUs)."""
    cascade_fused_decode: bool = False
    """OMLX_JOBS_CASCADE_FUSED_DECODE=1: cascade decode steps through mlx's fused attention (slower than the kernel
    path on an H200, bench/RESULTS.md; Metal is untested)."""
    cascade_packed: Mode = "auto"
    """OMLX_JOBS_CASCADE_PACKED: attend a decode step's prefix levels in one masked call over their keys packed
    together, however many groups and levels ("0" never: one call per level; "1" everywhere; else on GPUs)."""
    cascade_compile: Mode = "auto"
    """OMLX_JOBS_CASCADE_COMPILE=0: run cascade attention's mx ops one by one instead of compiled (on GPUs; the CPU
    never compiles them unless a test says "always")."""
    cpu_prefill: bool = True
    """OMLX_JOBS_CPU_PREFILL=0: leave every CPU prefill chunk to mlx's attention instead of causal blocks."""
    cascade_cost: bool = True
    """OMLX_JOBS_CASCADE_COST=0: reference every prefix level instead of letting the cost model copy the levels not
    worth a reference into their rows (worker/attention/cascade_cost.py)."""
    speculation: Literal["auto", "off"] = "off"
    """OMLX_JOBS_SPECULATION=auto (--speculation auto): draft from each row's own history and keep it on per row only
    while it pays (docs/speculation.md). Off by default until its controller holds a job that copies nothing
    within 3% of off: on CPU it measured 0.87x (bench/RESULTS.md)."""
    # Tuning, not read from the environment: tests set them to exercise more blocks and cuts.
    fused_rows_per_call: int = FUSED_ROWS_PER_CALL
    min_level_tokens: int = CASCADE_MIN_LEVEL_TOKENS
    level_costs: tuple[float, float, float, bool] | None = None
    """The cost model's device costs (cascade_cost.DeviceCosts' first four fields) instead of measuring them."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Switches:
        """The switches the environment sets (os.environ, or `environ`); unset variables keep the defaults."""
        env = os.environ if environ is None else environ
        return cls(
            cascade=env.get("OMLX_JOBS_CASCADE", "1") != "0",
            ragged_decode=env.get("OMLX_JOBS_RAGGED_DECODE", "1") != "0",
            cascade_prefix_kernel=env.get("OMLX_JOBS_CASCADE_PREFIX_KERNEL", "1") != "0",
            cascade_fused_prefill=_MODES.get(env.get("OMLX_JOBS_CASCADE_FUSED_PREFILL", "auto"), "auto"),
            cascade_fused_decode=env.get("OMLX_JOBS_CASCADE_FUSED_DECODE", "0") == "1",
            cascade_packed=_MODES.get(env.get("OMLX_JOBS_CASCADE_PACKED", "auto"), "auto"),
            cascade_compile="never" if env.get("OMLX_JOBS_CASCADE_COMPILE", "1") == "0" else "auto",
            cpu_prefill=env.get("OMLX_JOBS_CPU_PREFILL", "1") != "0",
            cascade_cost=env.get("OMLX_JOBS_CASCADE_COST", "1") != "0",
            speculation="auto" if env.get("OMLX_JOBS_SPECULATION", "off") == "auto" else "off",
        )


_MODES: dict[str, Mode] = {"0": "never", "1": "always"}


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
SUBMIT_LEASE = 120.0
"""Seconds a submit's hold on its job lasts unless renewed (every quarter of it, while it stores the file): a job
still validating past it lost its submit (killed), and reconcile or `resume` fails it."""
MAX_TOKENS = 256
"""max_tokens of a request that gives none."""
REDIS_URL = "redis://127.0.0.1:6379/0"
"""Redis when neither --redis-url nor OMLX_JOBS_REDIS_URL says otherwise."""
