"""The engine's configuration: batch sizes, the prefix cache's budgets, and the switches (defaults.Switches)."""

from __future__ import annotations

from dataclasses import dataclass, field

from omlx_jobs import defaults
from omlx_jobs.defaults import Switches


@dataclass
class EngineConfig:
    completion_batch_size: int = defaults.BATCH_SIZE
    prefill_batch_size: int = defaults.PREFILL_BATCH_SIZE
    prefill_step_size: int = defaults.PREFILL_STEP
    prefill_tokens: int = defaults.PREFILL_TOKENS
    """A prefill pass takes more than prefill_batch_size rows while their padded tokens fit this."""
    refill_rows: int | None = None
    """Free rows that trigger a refill of a running batch (None: completion_batch_size / REFILL_FRACTION)."""
    prefix_cache: bool = True
    min_shared_tokens: int = defaults.MIN_SHARED_TOKENS
    cache_memory: int | None = defaults.CACHE_MEMORY
    cache_dir: str | None = None
    cache_dir_bytes: int = defaults.CACHE_DIR_BYTES
    ignore_eos: bool = False
    """Generate max_tokens every time (for benchmarks)."""
    switches: Switches = field(default_factory=Switches.from_env)
    """The engine's switches (cascade attention, the CUDA kernels, CPU prefill, ...): read from the environment
    when a config is made, unless given (defaults.Switches)."""

    def __post_init__(self) -> None:
        if self.completion_batch_size < 1 or self.prefill_batch_size < 1 or self.prefill_step_size < 1:
            raise ValueError("batch sizes and the prefill step must be at least 1")
        if self.min_shared_tokens < 1:
            raise ValueError("min_shared_tokens must be at least 1")
